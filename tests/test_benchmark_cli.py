"""``python -m safestrategy --benchmark`` / ``--plot``: the nccl-tests table, the PNG, progress."""

import os
import re
import time

import pytest

from safestrategy import _benchmark

from .conftest import needs_tf

HAS_MATPLOTLIB = _benchmark.can_plot()
DEVICES = ("--devices", "/cpu:0", "/cpu:1")
#: One row of the table: size, count, type, redop, time (us), algbw, busbw.
ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+float\s+sum\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$")


def test_bus_bandwidth_is_nccl_tests_all_reduce_factor():
    row = _benchmark.Row(size=3 * 10**9, ms=1000.0)  # 3 GB in 1 s
    assert row.count == 750_000_000
    assert row.algbw == pytest.approx(3.0)
    assert row.busbw(2) == pytest.approx(3.0)  # 2(n-1)/n = 1
    assert row.busbw(3) == pytest.approx(4.0)  # 4/3
    assert row.busbw(8) == pytest.approx(5.25)  # 14/8


def _tables(stdout):
    """{backend: (chosen, [(size, count, us, algbw, busbw), ...])} from the benchmark part."""
    tables, current = {}, None
    for line in stdout.split("# median of", 1)[1].splitlines():
        heading = re.match(r"^# (\w+)(  \(chosen\))?$", line)
        if heading:
            current = heading.group(1)
            tables[current] = (bool(heading.group(2)), [])
        elif ROW.match(line):
            numbers = ROW.match(line).groups()
            tables[current][1].append(tuple(float(n) for n in numbers))
    return tables


@needs_tf
def test_benchmark_times_every_backend_that_passed_and_marks_the_chosen(run_cli):
    done = run_cli("--benchmark", *DEVICES)
    assert done.returncode == 0, done.stderr
    report = done.stdout.split("\n\n")[1]
    passed = re.findall(r"^  (\w+) +ok ", report, re.MULTILINE)
    chosen = re.search(r"^backend +(\w+)", report, re.MULTILINE).group(1)
    tables = _tables(done.stdout)
    assert list(tables) == passed and len(passed) >= 2  # TF's every CPU backend but NCCL
    assert [name for name, (mark, _) in tables.items() if mark] == [chosen]
    for _, rows in tables.values():
        assert [row[0] for row in rows] == list(_benchmark.SIZES)
        for size, count, us, algbw, busbw in rows:
            assert count == size / 4
            assert 0 < us < 60e6  # a minute: a hang or a unit slip, not a measurement
            assert algbw == pytest.approx(size / us / 1e3, abs=0.006)  # printed to 0.01
            assert busbw == algbw  # 2 devices: 2(n-1)/n = 1
            assert algbw < 1000  # GB/s: nothing on a CPU moves a terabyte a second


@needs_tf
@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed on this leg")
def test_plot_writes_a_png(run_cli, tmp_path):
    out = tmp_path / "out.png"
    done = run_cli("--plot", str(out), *DEVICES)
    assert done.returncode == 0, done.stderr
    assert f"# plot written to {out}" in done.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000  # axes, lines and labels, not an empty canvas


@pytest.mark.skipif(HAS_MATPLOTLIB, reason="matplotlib is installed on this leg")
def test_plot_without_matplotlib_exits_2_with_the_install_command(run_cli, tmp_path):
    out = tmp_path / "out.png"
    done = run_cli("--plot", str(out), *DEVICES)
    assert done.returncode == 2
    assert "pip install 'safestrategy[bench]'" in done.stderr
    assert done.stdout == ""  # found out before anything was checked
    assert not out.exists()


def test_json_with_benchmark_is_a_bad_argument(run_cli):
    done = run_cli("--json", "--benchmark", *DEVICES)
    assert done.returncode == 2
    assert "--json prints the report only" in done.stderr


def test_elapsed_time_shows_while_nccl_is_checked(fake, capsys, monkeypatch):
    from safestrategy import cli

    monkeypatch.setattr(cli, "PROGRESS_EVERY", 0.5)
    fake("hang")
    status = cli.main(["--devices", "/gpu:0", "/gpu:1", "--backend", "nccl", "--timeout", "3"])
    assert status == 1
    out = capsys.readouterr().out
    checking, rest = out.split("  nccl ", 1)
    ticks = re.findall(r"^  \.\.\. (\d+) s elapsed$", checking, re.MULTILINE)
    assert len(ticks) >= 3  # every half second of the 3 s the hanging check took
    assert rest.split()[0] == "timeout"


# What may hang runs in a probe process, bounded; a sweep or plot that fails is one line.

#: Two sizes keep the sweeps (and a hung one's bound: the timeout per size) short.
TWO_SIZES = (4096, 16384)


def _report(devices, *candidates, backend=None):
    """A report whose candidates passed as given: (name, reason, remedy)."""
    from safestrategy.report import OK, CandidateResult, Report

    results = tuple(
        CandidateResult(name, OK, reason, 0.1, remedy=remedy) for name, reason, remedy in candidates
    )
    return Report(
        backend=backend or results[0].name,
        source="default",
        mode="auto",
        devices=tuple(devices),
        platform="Linux",
        tf_version="2.99.0",
        tf_api="tf2",
        candidates=results,
        reason="fastest",
    )


def _args(timeout, plot=None):
    import argparse

    return argparse.Namespace(timeout=timeout, plot=plot)


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_hanging_nccl_sweep_is_killed_at_its_bound_and_the_others_still_print(
    fake, tf, capsys, monkeypatch
):
    from safestrategy import cli

    monkeypatch.setattr(_benchmark, "SIZES", TWO_SIZES)
    pidfile = fake("hang")
    report = _report(
        ["/cpu:0", "/cpu:1"],
        ("nccl", "", {"NCCL_P2P_DISABLE": "1"}),
        ("reduce_to_cpu", "", {}),
        backend="reduce_to_cpu",
    )
    started = time.monotonic()
    status = cli._benchmark_and_plot(tf, report, _args(timeout=1.0))
    assert time.monotonic() - started < 30  # 2 s for the hung sweep, then reduce_to_cpu here
    assert status == 0
    out = capsys.readouterr().out
    assert "# nccl: not measured: no answer within 2 s; the probe process was killed\n" in out
    tables = _tables(out)
    assert list(tables) == ["reduce_to_cpu"]
    assert [row[0] for row in tables["reduce_to_cpu"][1]] == list(TWO_SIZES)
    assert _gone(int(pidfile.read_text()))
    # the remedy went to the probe process, not into the CLI's own environment
    assert fake.starts() == ["start NCCL_P2P_DISABLE=1"]
    assert "NCCL_P2P_DISABLE" not in os.environ


def test_nccl_and_collective_on_nccl_are_swept_in_a_probe_process_each(fake, tf, monkeypatch):
    monkeypatch.setattr(_benchmark, "SIZES", TWO_SIZES)
    fake("ok")
    monkeypatch.setenv("FAKE_WORKER_MS", "nccl=0.5,collective=0.25")
    report = _report(
        ["/gpu:0", "/gpu:1"],
        ("collective", "passed (NCCL requested)", {}),
        ("nccl", "", {}),
    )
    sweeps = list(_benchmark.measure(tf, report, 60.0))
    assert [(s.backend, s.chosen, s.failed) for s in sweeps] == [
        ("collective", True, None),
        ("nccl", False, None),
    ]
    assert [[row.ms for row in s.rows] for s in sweeps] == [[0.25, 0.25], [0.5, 0.5]]
    assert fake.starts() == ["start", "start"]


@pytest.mark.parametrize(
    "behaviour, why",
    [
        ("sweep-hang", "no answer within 2 s; the probe process was killed"),
        ("sweep-error", "InternalError: NCCL: unhandled cuda error (fake sweep)"),
        ("abort", "the probe process died: killed by signal SIGABRT"),
        ("die-at-start", "the probe process could not start: it died: exit status 3"),
    ],
)
def test_an_nccl_sweep_that_fails_in_the_probe_process_says_why(
    fake, tf, monkeypatch, behaviour, why
):
    monkeypatch.setattr(_benchmark, "SIZES", TWO_SIZES)
    fake(behaviour)
    report = _report(["/gpu:0", "/gpu:1"], ("nccl", "", {}))
    (sweep,) = _benchmark.measure(tf, report, 1.0)
    assert (sweep.backend, sweep.rows) == ("nccl", [])
    assert sweep.failed.startswith(why)


def test_a_hanging_nccl_sweep_through_the_cli_is_one_line_and_exit_0(fake, capsys, monkeypatch):
    from safestrategy import cli

    monkeypatch.setattr(_benchmark, "SIZES", TWO_SIZES)
    fake("sweep-hang")  # the check passes, the sweep hangs
    started = time.monotonic()
    status = cli.main(
        ["--benchmark", "--devices", "/gpu:0", "/gpu:1", "--backend", "nccl", "--timeout", "1"]
    )
    assert time.monotonic() - started < 60
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.rstrip().endswith(
        "# nccl: not measured: no answer within 2 s; the probe process was killed"
    )


@needs_tf
def test_an_in_process_sweep_that_fails_gets_its_line_and_the_others_still_print(
    tf, capsys, monkeypatch
):
    from safestrategy import cli
    from safestrategy.checks import timing

    monkeypatch.setattr(_benchmark, "SIZES", TWO_SIZES)
    real = timing.batches_ms

    def batches_ms(tf, era, devices, name, *rest, **kwargs):
        if name == "hierarchical_copy":
            raise RuntimeError("fake: out of host memory\nand a second line")
        return real(tf, era, devices, name, *rest, **kwargs)

    monkeypatch.setattr(timing, "batches_ms", batches_ms)
    report = _report(["/cpu:0", "/cpu:1"], ("hierarchical_copy", "", {}), ("reduce_to_cpu", "", {}))
    assert cli._benchmark_and_plot(tf, report, _args(timeout=60.0)) == 0
    out = capsys.readouterr().out
    assert "# hierarchical_copy: not measured: RuntimeError: fake: out of host memory\n" in out
    assert list(_tables(out)) == ["reduce_to_cpu"]
    assert len(_tables(out)["reduce_to_cpu"][1]) == len(TWO_SIZES)


@pytest.mark.parametrize("where", ["missing/out.png", "."])
def test_an_unwritable_plot_path_exits_2_naming_it_before_anything_is_checked(
    capsys, monkeypatch, tmp_path, where
):
    from safestrategy import cli

    def decide(*args, **kwargs):
        raise AssertionError("checked before --plot was refused")

    monkeypatch.setattr(_benchmark, "can_plot", lambda: True)  # legs without matplotlib too
    monkeypatch.setattr(cli, "decide", decide)
    path = tmp_path / where
    status = cli.main(["--plot", str(path), "--devices", "/cpu:0", "/cpu:1"])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ""
    why = f"no directory {tmp_path / 'missing'}" if where != "." else "it is a directory"
    assert captured.err == f"safestrategy: error: --plot cannot write {path}: {why}\n"


@pytest.mark.parametrize(
    "measured, why",
    [
        (True, "OSError: [Errno 28] No space left on device"),
        (False, "RuntimeError: no backend was measured"),
    ],
)
def test_a_plot_that_cannot_be_drawn_is_one_line_and_exit_1(
    capsys, monkeypatch, tmp_path, measured, why
):
    from safestrategy import cli

    def measure(tf, report, timeout, before=None):
        if measured:
            yield _benchmark.Sweep("reduce_to_cpu", True, [_benchmark.Row(4096, 0.1)])
        else:
            yield _benchmark.Sweep("reduce_to_cpu", True, [], "RuntimeError: fake")

    def plot(sweeps, report, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_benchmark, "measure", measure)
    monkeypatch.setattr(_benchmark, "plot", plot)
    report = _report(["/cpu:0", "/cpu:1"], ("reduce_to_cpu", "", {}))
    status = cli._benchmark_and_plot(None, report, _args(60.0, plot=str(tmp_path / "out.png")))
    captured = capsys.readouterr()
    assert status == 1
    assert captured.err == f"safestrategy: could not draw the plot: {why}\n"
    assert "# plot written" not in captured.out


@needs_tf
def test_the_probe_process_sweeps_for_real_and_says_why_it_could_not(tf):
    from safestrategy.checks import probe

    process, _ = probe.start({"job": "mirrored", "devices": ["/cpu:0", "/cpu:1"]}, 300)
    with process:
        times = probe.sweep_ms(process, "reduce_to_cpu", [1024, 4096], 2, 300)
        assert len(times) == 2 and all(0 < ms < 60_000 for ms in times)
        with pytest.raises(RuntimeError) as raised:
            probe.sweep_ms(process, "no_such_backend", [1024], 1, 300)
        assert not isinstance(raised.value, probe.ProbeDied)  # it answered: still there
        assert str(raised.value) == "KeyError: 'no_such_backend'"
        assert process.alive
