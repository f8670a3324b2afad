"""Fail when a test was skipped on every leg: it then tests nothing anywhere.

Usage: python .ci/skipped_everywhere.py REPORT.xml [REPORT.xml ...]
(JUnit XML from pytest, one per TensorFlow leg). Standard library only.
"""

import sys
import xml.etree.ElementTree as ElementTree


def outcomes(path):
    """{test id: skipped?} for one JUnit report."""
    result = {}
    for case in ElementTree.parse(path).iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        result[test_id] = case.find("skipped") is not None
    return result


def main(paths):
    if not paths:
        print("skipped_everywhere: no JUnit reports given", file=sys.stderr)
        return 1
    legs = [outcomes(path) for path in paths]
    tests = set().union(*legs)
    everywhere = sorted(t for t in tests if all(leg.get(t, True) for leg in legs))
    for test_id in everywhere:
        print(f"skipped on every leg ({len(paths)}): {test_id}")
    print(f"skip guard: {len(tests)} tests over {len(paths)} legs, {len(everywhere)} never ran")
    return 1 if everywhere else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
