"""``python -m safestrategy``: print the backend report for this machine."""

import sys

from .cli import main

sys.exit(main())
