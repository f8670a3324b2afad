"""A stand-in probe process for the cross-worker NCCL check (the "multiworker" job).

It speaks safestrategy._worker's protocol without TensorFlow, as the task its
TF_CONFIG names (the probe cluster). FAKE_MW says how each worker's check
behaves: "ok" (right sums, two replicas per worker), or "BEHAVIOUR:INDEX" to
make worker INDEX "hang" (a broken NCCL), "abort" (a crashing one), give a
"wrong" sum or "die-at-start"; "p2p" makes every worker hang unless
NCCL_P2P_DISABLE=1 is set (a remedy that works).
"""

import json
import os
import sys
import time

PREFIX = "@safestrategy@ "  # safestrategy._probe.PREFIX: marks protocol lines
config = json.loads(os.environ["TF_CONFIG"])
index = config["task"]["index"]
workers = len(config["cluster"]["worker"])
setting = os.environ.get("FAKE_MW", "ok")
kind, _, target = setting.partition(":")
behaviour = kind if target == str(index) else "ok"
if setting == "p2p":
    behaviour = "ok" if os.environ.get("NCCL_P2P_DISABLE") == "1" else "hang"
if behaviour == "die-at-start":
    print("fake: cannot load libnccl.so.2", file=sys.stderr, flush=True)
    sys.exit(3)
print(PREFIX + json.dumps({"facts": {"tf_version": "2.99.0", "gpus": 2}}), flush=True)
replicas = 2 * workers
for _request in sys.stdin:
    if behaviour == "hang":
        time.sleep(3600)
    elif behaviour == "abort":
        os.abort()
    total = replicas * (replicas + 1) / 2 - (1 if behaviour == "wrong" else 0)
    values = [[f"/job:worker/task:{index}/device:GPU:{i}", [total] * 4] for i in range(2)]
    print(PREFIX + json.dumps({"values": values, "replicas": replicas}), flush=True)
