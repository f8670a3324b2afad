"""A training for ``python -m safestrategy run``'s tests (tests/test_run.py).

    python tests/run_script.py SCENARIO

A Keras ``fit`` of 3 epochs on two logical CPUs with ``make_mirrored_strategy`` and
``BackupAndRestore`` (a relaunch resumes after the last finished epoch); a layer
calls ``tf.py_function`` so that a step can be made to misbehave, and
the all-reduce can be hung (tests/hung_allreduce.py). Trouble is
injected on the first launch only (``SAFESTRATEGY_RESTART`` is 0), in epoch 2:

- ``stall``: the all-reduce blocks (the canary through it too: recorded);
- ``always-stall``: every launch's all-reduce blocks;
- ``crash``: a step fails with an NCCL error;
- ``first-step``: the very first step (0.5 s after the factory, before any heartbeat)
  aborts (SIGABRT), as NCCL usually dies;
- ``starve``: a step holds the GIL (``sleep`` through ``ctypes.PyDLL``), so the
  watchdog's thread cannot run, and neither can its heartbeat; the first launch also
  leaves a (fake) probe process and a grandchild that ignores SIGTERM (``ORPHANS <pids>``);
- ``user``: the script's own ``ValueError`` before any training;
- ``teardown``: training ends, then the process aborts;
- ``checkpoint``: ``stall``, resumed the way keras-io's multi-GPU guide does it: a
  ``ModelCheckpoint`` each epoch, the latest loaded at start, ``fit(initial_epoch=)``;
- ``corrupt``: the all-reduce's result on replica 1 goes wrong from the 6th all-reduce
  (epoch 2) on (tests/mirror_faults.py), checked every 2 steps;
- ``manager``: a custom training loop (its step all-reduces the model's output) whose
  all-reduce stalls at its 5th step on the first launch,
  saving a ``tf.train.CheckpointManager`` checkpoint every step and restoring the
  latest at start. Prints ``STEPS <n run>``.

The watched part starts after the step is compiled, so a loaded machine's slow
compile is never a stall. Prints ``BACKEND <name>`` and ``EPOCHS <n run>``.

By hand, as docs/healing.md shows it::

    SAFESTRATEGY_BACKEND=hierarchical_copy,reduce_to_cpu \
        python -m safestrategy run -- python tests/run_script.py stall

``RUN_SCRIPT_BACKUP`` names the directory that keeps the training's state from one
launch to the next (``BackupAndRestore``, the checkpoints); unset, it is a temporary
directory of this ``run`` (named after the run directory every launch of one run shares).
``RUN_SCRIPT_STALL_TIMEOUT`` (default 3) is the watched part's stall timeout.
"""

import ctypes
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import tensorflow as tf

import safestrategy
from safestrategy import _tf
from tests import hung_allreduce

SCENARIO = sys.argv[1]
FIRST = os.environ.get("SAFESTRATEGY_RESTART") == "0"
T = os.environ.pop("RUN_SCRIPT_STALL_TIMEOUT", "3")
# one run's launches share their run directory's parent (<cache>/runs/<this run>/launch-N)
RUN_DIR = os.environ.get("SAFESTRATEGY_RUN_DIR", "").strip()
RUN = os.path.basename(os.path.dirname(RUN_DIR)) if RUN_DIR else str(os.getppid())
BACKUP = os.environ.get("RUN_SCRIPT_BACKUP") or os.path.join(
    tempfile.gettempdir(), f"run_script-{SCENARIO}-{RUN}"
)
DEVICES = ["/cpu:0", "/cpu:1"]
_tf.configure_logical_cpus(tf, 2)
trouble = {"armed": False}
hang = hung_allreduce.install(tf, canary_fails=True)  # a conviction without the bound's wait


def misbehave(x):
    if not trouble["armed"]:
        return x
    trouble["armed"] = False
    if SCENARIO in ("stall", "always-stall", "checkpoint", "manager"):
        hang.set()  # the all-reduce: the step waits in it from now on
    if SCENARIO == "crash":
        raise RuntimeError("ncclUnhandledCudaError: Call to CUDA function failed (fake)")
    if SCENARIO == "first-step":
        os.abort()
    if SCENARIO == "starve":
        time.sleep(2.0)  # inside the step long enough for a heartbeat to say so
        ctypes.PyDLL(None).sleep(3600)  # holds the GIL
    return x


class Troubled(tf.keras.layers.Layer):
    def call(self, x):
        y = tf.py_function(misbehave, [x], tf.float32)
        y.set_shape(x.shape)
        return y


class Arm(tf.keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs += 1
        if epoch == 1 and (FIRST or SCENARIO == "always-stall"):
            trouble["armed"] = True


if SCENARIO == "corrupt" and FIRST:
    from tests import mirror_faults

    mirror_faults.inject("corrupt", replica=1, start=6)
    os.environ["SAFESTRATEGY_VERIFY_EVERY"] = "2"
if SCENARIO == "user":
    raise ValueError("the learning rate must be positive (the script's own error)")
os.environ["SAFESTRATEGY_STALL_TIMEOUT"] = "off"  # compile first, unwatched
strategy = safestrategy.make_mirrored_strategy(DEVICES)
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input((4,)), Troubled(), tf.keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
x, y = np.ones((32, 4), np.float32), np.ones((32, 1), np.float32)
trouble["armed"] = SCENARIO == "first-step" and FIRST
model.train_on_batch(x[:8], y[:8])  # the step is traced and compiled here, unwatched
os.environ["SAFESTRATEGY_STALL_TIMEOUT"] = T
safestrategy.make_mirrored_strategy(DEVICES)  # the same decision, now watched
print("BACKEND", safestrategy.last_report().backend, flush=True)
if SCENARIO == "starve" and FIRST:
    import subprocess

    from safestrategy.checks import probe

    ignores = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    grandchild = subprocess.Popen([sys.executable, "-c", ignores])
    fake = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_worker.py")
    probe.CHILD_COMMAND = [sys.executable, fake]
    os.environ["FAKE_WORKER"] = "hang"
    process, _ = probe.start({"job": "mirrored", "devices": DEVICES}, 60)  # left open
    print("ORPHANS", grandchild.pid, process.process.pid, flush=True)
arm = Arm()
if SCENARIO == "checkpoint":  # keras-io's multi-GPU guide: ModelCheckpoint, restore at start
    os.makedirs(BACKUP, exist_ok=True)
    saved = sorted(name for name in os.listdir(BACKUP) if name.endswith(".weights.h5"))
    first_epoch = 0
    if saved:
        model.load_weights(os.path.join(BACKUP, saved[-1]))
        first_epoch = int(saved[-1].split(".")[0].split("-")[1])
    path = os.path.join(BACKUP, "epoch-{epoch}.weights.h5")
    save = tf.keras.callbacks.ModelCheckpoint(path, save_weights_only=True)
    model.fit(
        x, y, batch_size=8, epochs=3, initial_epoch=first_epoch, verbose=0, callbacks=[save, arm]
    )
elif SCENARIO == "manager":  # a custom loop with tf.train.CheckpointManager
    with strategy.scope():
        step_count = tf.Variable(0, dtype=tf.int64, trainable=False)
    checkpoint = tf.train.Checkpoint(model=model, step=step_count)
    manager = tf.train.CheckpointManager(checkpoint, BACKUP, max_to_keep=2)
    checkpoint.restore(manager.latest_checkpoint)

    @tf.function
    def train_step(batch):
        def replica(batch):
            return tf.distribute.get_replica_context().all_reduce("sum", model(batch))

        return strategy.run(replica, args=(batch,))

    train_step(tf.ones((8, 4)))  # traced before the watched steps
    done = 0
    while int(step_count.numpy()) < 8:
        if FIRST and int(step_count.numpy()) == 4:
            trouble["armed"] = True
        train_step(tf.ones((8, 4)))
        step_count.assign_add(1)
        manager.save()
        done += 1
    print("STEPS", done, flush=True)
else:
    backup = tf.keras.callbacks.BackupAndRestore(BACKUP)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[backup, arm])
print("EPOCHS", arm.epochs, flush=True)
if SCENARIO == "teardown" and FIRST:
    time.sleep(2 * min(5.0, float(T) / 5) + 1)  # the heartbeat has said "outside" since
    os.abort()
