"""One worker of the which-worker-holds-the-others-back tests (tests/test_peers.py).

    python tests/peers_worker.py SCENARIO CULPRIT

``make_multiworker_strategy()`` (RING on CPUs), one compiled step while the
watchdog is off, then ``SAFESTRATEGY_STALL_TIMEOUT`` (from ``PEERS_STALL_TIMEOUT``)
turns it on and the workers step until one of:

- ``sleep``: worker CULPRIT sleeps in its own Python between steps;
- ``input``: worker CULPRIT's input pipeline (a generator) blocks;
- ``stop``: nothing here: the test SIGSTOPs worker CULPRIT after ``READY``;
- ``interrupt``: nothing here: the test sends worker CULPRIT SIGINT (its user's Ctrl-C);
- ``all``: every worker's step blocks in a ``py_function`` (the same step);
- ``stuck``: as ``all``, and the canary rounds' all-reduce hangs too (the seam of a
  stuck communication: the canary is the only evidence the watchdog takes);
- ``read``: worker CULPRIT blocks in an eager file read outside any step (a FIFO no one
  writes: a hung file system), while the others wait in the step's all-reduce;
- ``checkpoint``: every worker writes a checkpoint of an ``ON_READ`` variable (its save
  all-reduces it) after every step; worker CULPRIT sleeps before one;
- ``steady``: ``PEERS_ROUNDS`` rounds of ``PEERS_STEPS`` steps, publishing on every
  other round (``benchmarks/peers_overhead.py``): prints ``ROUND <n> <on|off> <s>``,
  then ``PUBLISHED`` and how long each sample's publishing took (s).

Prints ``READY <pid>`` once stepping. :func:`cluster` starts the workers over TF_CONFIG
(for the tests and ``benchmarks/peers_trials.py``); under ``srun`` they take Slurm's step.
"""

import contextlib
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def cluster(where, scenario, culprit, count, stall, wait, fail):
    """``count`` workers of ``scenario`` started in ``where`` (each writes ``out-<i>`` and
    ``err-<i>``, and has its own cache ``c<i>``), all READY within ``wait`` s (else
    ``fail(why)``); yields (processes, [(out, err)]); every one is killed at the end."""
    from tests.conftest import tf_configs  # the test process's; the workers never import it

    base = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    base.update(PEERS_STALL_TIMEOUT=str(stall), SAFESTRATEGY_STALL_ACTION="exit")
    processes, outputs = [], []
    try:
        for index, config in enumerate(tf_configs(count)):
            out, err = where / f"out-{index}", where / f"err-{index}"
            env = dict(base, TF_CONFIG=config, SAFESTRATEGY_CACHE_DIR=str(where / f"c{index}"))
            with open(out, "w") as stdout, open(err, "w") as stderr:
                command = [sys.executable, os.path.abspath(__file__), scenario, str(culprit)]
                processes.append(subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env))
            outputs.append((out, err))
        deadline = time.monotonic() + wait
        while not all("READY" in out.read_text() for out, _ in outputs):
            died = [p.returncode for p in processes if p.poll() is not None]
            if died or time.monotonic() > deadline:
                tails = "\n".join(err.read_text()[-2000:] for _, err in outputs)
                fail(f"the workers did not all start (exits {died}):\n{tails}")
            time.sleep(0.2)
        yield processes, outputs
    finally:
        for process in processes:
            with contextlib.suppress(OSError):
                process.kill()
            process.wait(timeout=30)


def main(scenario, culprit):
    os.environ["SAFESTRATEGY_STALL_TIMEOUT"] = "off"  # the first step compiles unwatched
    sys.path.insert(0, ROOT)
    import tensorflow as tf

    import safestrategy
    from safestrategy import _env
    from safestrategy.training import publish, watchdog

    armed = {"on": False}
    strategy = safestrategy.make_multiworker_strategy()  # TF_CONFIG, or Slurm's step
    index = int(safestrategy.last_report().task.split(":")[1])

    def value(x):
        if armed["on"] and scenario in ("all", "stuck"):
            time.sleep(3600)
        return x

    with strategy.scope():  # a metric's kind of variable: a checkpoint all-reduces it
        counted = tf.Variable(
            0.0,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )
    saved = tf.train.Checkpoint(counted=counted)

    @tf.function
    def step(x):
        def replica(x):
            x = tf.py_function(value, [x], tf.float32)
            return tf.distribute.get_replica_context().all_reduce("sum", x)

        return strategy.run(replica, (x,))

    def batches():
        while True:
            if armed["on"] and scenario == "input" and index == culprit:
                time.sleep(3600)
            yield 1.0

    spec = tf.TensorSpec((), tf.float32)
    data = iter(tf.data.Dataset.from_generator(batches, output_signature=spec))
    step(next(data))  # traced and compiled
    os.environ["SAFESTRATEGY_STALL_TIMEOUT"] = os.environ["PEERS_STALL_TIMEOUT"]
    watched = watchdog._watched[-1]
    board = watchdog._board
    watchdog.watch(_env.resolve_stall(), watched.report, strategy, watched.place, board)
    if scenario == "stuck":  # the seam: the canary's own all-reduce never answers
        watchdog._rounds.collective = lambda number: time.sleep(3600)
    armed["on"] = True
    print("READY", os.getpid(), flush=True)
    if scenario == "steady":
        rounds, steps = int(os.environ["PEERS_ROUNDS"]), int(os.environ["PEERS_STEPS"])
        spent = []  # each sample's publishing, in seconds: its cost where it is paid
        publish = publish.publish

        def timed(*args):
            started = time.perf_counter()
            try:
                return publish(*args)
            finally:
                spent.append(time.perf_counter() - started)

        publish.publish = timed
        for number in range(rounds):
            publishing = number % 2 == 0  # the same rounds on every worker: they step together
            watchdog._board = board if publishing else None
            started = time.perf_counter()
            for _ in range(steps):
                step(next(data))
            seconds = time.perf_counter() - started
            print("ROUND", number, "on" if publishing else "off", seconds, flush=True)
        print("PUBLISHED", " ".join(f"{seconds:.6f}" for seconds in spent), flush=True)
        os._exit(0)
    fifo = os.path.join(os.environ["SAFESTRATEGY_CACHE_DIR"], "fifo")
    for number in range(100000):
        if scenario == "sleep" and index == culprit and number == 3:
            time.sleep(3600)  # the user's own Python, between steps
        if scenario == "read" and index == culprit and number == 3:
            os.makedirs(os.path.dirname(fifo), exist_ok=True)
            os.mkfifo(fifo)
            tf.io.read_file(fifo)  # an eager op that never returns: no one writes the FIFO
        step(next(data))
        if scenario == "checkpoint":
            if index == culprit and number == 3:
                time.sleep(3600)  # late to the save every worker makes
            saved.write(os.path.join(os.environ["SAFESTRATEGY_CACHE_DIR"], f"ckpt-{number}"))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
