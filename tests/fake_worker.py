"""A stand-in probe process for what TensorFlow cannot show on a CPU.

It speaks safestrategy._worker's protocol without TensorFlow. FAKE_WORKER
selects how each check behaves: "ok" (right sums), "wrong" (replica 1's value
dropped, as HierarchicalCopyAllReduce does on odd counts), "error", "hang"
(a broken NCCL) or "abort" (a crashing one); "die-at-start" exits before
reporting facts; "noisy" first writes 256 KiB of stderr with bytes that are
not UTF-8 (nor cp1252, nor ASCII), then acts as "ok".
FAKE_WORKER_PIDFILE, if set, receives the pid.
"""

import json
import os
import sys
import time

behaviour = os.environ.get("FAKE_WORKER", "ok")
if os.environ.get("FAKE_WORKER_PIDFILE"):
    with open(os.environ["FAKE_WORKER_PIDFILE"], "w") as pidfile:
        pidfile.write(str(os.getpid()))
if behaviour == "die-at-start":
    print("fake: cannot load libcuda.so.1", file=sys.stderr, flush=True)
    sys.exit(3)

if behaviour == "noisy":
    for _ in range(4096):
        sys.stderr.buffer.write(b"W tensorflow: caf\xe9 \x81\x8d\xff " + b"x" * 40 + b"\n")
    sys.stderr.flush()
devices = json.loads(sys.argv[1])["devices"] or ["/device:GPU:0", "/device:GPU:1"]
facts = {"tf_version": "2.99.0", "devices": devices, "gpus": 2, "nccl_kernels": 0}
print(json.dumps({"facts": facts}), flush=True)
n = len(devices)
for _request in sys.stdin:
    if behaviour == "hang":
        time.sleep(3600)
    elif behaviour == "abort":
        os.abort()
    elif behaviour == "error":
        reply = {"error": ["InvalidArgumentError", "No OpKernel was registered (fake)"]}
    else:
        total = n * (n + 1) / 2 - (2 if behaviour == "wrong" else 0)
        reply = {"values": [[device, [total] * 4] for device in devices]}
    print(json.dumps(reply), flush=True)
