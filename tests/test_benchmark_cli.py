"""``python -m safestrategy --benchmark`` / ``--plot``: the nccl-tests table, the PNG, progress."""

import re

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
