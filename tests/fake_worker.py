"""A stand-in probe process for what TensorFlow cannot show on a CPU.

It speaks safestrategy._worker's protocol without TensorFlow, and sets itself
up with the real worker's ``connect()`` (dies with its parent, protocol lines
marked, stdin watchdog). FAKE_WORKER selects how each check behaves:

- "ok" (right sums), "wrong" (replica 1's value dropped, as
  HierarchicalCopyAllReduce does on odd counts), "error", "oom" (an
  out-of-memory error), "hang" (a broken NCCL), "abort" (a crashing one);
- "die-at-start" exits before reporting facts, saying why on stderr, "silent-death"
  without a word; "slow-start" never reports
  them; "banner" prints a line to stdout before anything else, as a
  sitecustomize might; "garbage" answers a check with a protocol line that is
  not JSON; "noisy" first writes 256 KiB of stderr with bytes that are not
  UTF-8 (nor cp1252, nor ASCII), then acts as "ok";
- "hang-unless-VAR" / "error-unless-VAR": hang, or fail with an NCCL error,
  unless the environment variable VAR is set (an NCCL that a remedy fixes);
- "NAME-error-unless-VAR": only backend NAME's check fails with an NCCL error
  unless VAR is set; every other check passes.

A timing request ({"time": NAME}) is answered from FAKE_WORKER_MS ("nccl=1,collective=3"):
by default NCCL takes 1.0 ms and anything else 2.0, as on a real multi-GPU machine
("NAME=hang": timing NAME hangs); a
benchmark sweep ({"sweep": NAME, "sizes": [...]}) gets that time for every size. "hang"
hangs both and "abort" aborts both, as a broken NCCL would; "sweep-hang" / "sweep-error"
pass the check and time the payload, then hang or fail the sweep.

FAKE_WORKER_PIDFILE, if set, receives the pid; FAKE_WORKER_LOG, if set, gets
one line per start ("start" and the NCCL_* variables it was given);
FAKE_WORKER_STDERR, if set, is written to stderr first (TensorFlow's banner).
"""

import json
import os
import sys
import time

# The safestrategy under test (this checkout), not a copy installed in site-packages.
here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get("FAKE_WORKER_ROOT", here))

behaviour = os.environ.get("FAKE_WORKER", "ok")
if os.environ.get("FAKE_WORKER_PIDFILE"):
    with open(os.environ["FAKE_WORKER_PIDFILE"], "w") as pidfile:
        pidfile.write(str(os.getpid()))
if os.environ.get("FAKE_WORKER_LOG"):
    with open(os.environ["FAKE_WORKER_LOG"], "a") as log:
        nccl = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("NCCL_"))
        log.write(" ".join(["start", *nccl]) + "\n")
if os.environ.get("FAKE_WORKER_STDERR"):
    print(os.environ["FAKE_WORKER_STDERR"], file=sys.stderr, flush=True)
if behaviour == "silent-death":
    sys.exit(3)
if behaviour == "die-at-start":
    print("fake: cannot load libcuda.so.1", file=sys.stderr, flush=True)
    sys.exit(3)
if behaviour == "banner":
    print("Welcome to the cluster! (a sitecustomize banner)", flush=True)
for condition, broken in (("hang-unless-", "hang"), ("error-unless-", "nccl-error")):
    if behaviour.startswith(condition):
        behaviour = "ok" if behaviour[len(condition) :] in os.environ else broken
failing = None  # "NAME-error-unless-VAR": the one backend whose check fails
if "-error-unless-" in behaviour:
    name, variable = behaviour.split("-error-unless-")
    failing, behaviour = (None if variable in os.environ else name), "ok"

from safestrategy.checks.child import connect  # noqa: E402
from safestrategy.checks.probe import PREFIX  # noqa: E402  (after the banner, as in real life)

raw_stdout = os.fdopen(os.dup(1), "w")  # the protocol stream, for "garbage" to write into
request = json.loads(sys.argv[1])
send, requests = connect(request)
if behaviour == "noisy":
    for _ in range(4096):
        sys.stderr.buffer.write(b"W tensorflow: caf\xe9 \x81\x8d\xff " + b"x" * 40 + b"\n")
    sys.stderr.flush()
if behaviour == "slow-start":  # e.g. TensorFlow's import on a loaded machine
    time.sleep(3600)
devices = request["devices"] or ["/device:GPU:0", "/device:GPU:1"]
send({"facts": {"tf_version": "2.99.0", "devices": devices, "gpus": 2, "nccl_kernels": 1}})
n = len(devices)
times = dict(pair.split("=") for pair in os.environ.get("FAKE_WORKER_MS", "").split(",") if pair)


def ms(name):
    return float(times.get(name, 1.0 if name == "nccl" else 2.0))


while True:
    message = json.loads(requests.get())
    sweep = "sweep" in message  # a --benchmark sweep: "hang" hangs it, "abort" aborts
    if sweep and behaviour == "sweep-hang":
        time.sleep(3600)
    elif sweep and behaviour == "sweep-error":
        send({"error": ["InternalError", "NCCL: unhandled cuda error (fake sweep)"]})
    elif sweep and behaviour not in ("hang", "abort"):
        send({"ms": [ms(message["sweep"])] * len(message["sizes"])})
    elif "time" in message and times.get(message["time"]) == "hang":
        time.sleep(3600)
    elif "time" in message and behaviour != "hang":  # timed after it passed: FAKE_WORKER_MS
        send({"ms": ms(message["time"])})
    elif message.get("check") is not None and message.get("check") == failing:
        send({"error": ["InternalError", "NCCL: unhandled system error (fake)"]})
    elif behaviour == "hang":
        time.sleep(3600)
    elif behaviour == "abort":
        print("F external/nccl/src/init.cc: NCCL abort (fake)", file=sys.stderr, flush=True)
        os.abort()
    elif behaviour == "garbage":
        raw_stdout.write(PREFIX + "{'values': oops\n")
        raw_stdout.flush()
    elif behaviour == "error":
        send({"error": ["InvalidArgumentError", "No OpKernel was registered (fake)"]})
    elif behaviour == "nccl-error":
        send({"error": ["InternalError", "NCCL: unhandled system error (fake)"]})
    elif behaviour == "oom":
        send({"error": ["ResourceExhaustedError", "OOM when allocating tensor (fake)"]})
    else:
        total = n * (n + 1) / 2 - (2 if behaviour == "wrong" else 0)
        send({"values": [[device, [total] * 4] for device in devices]})
