"""``python -m safestrategy`` in a subprocess, on this leg's real TensorFlow."""

import json
import re
import shlex
import subprocess

import pytest

from safestrategy import _env, cli

from .conftest import ROOT, needs_tf

pytestmark = needs_tf


@pytest.fixture(scope="module")
def tf_version():
    from safestrategy._tf import tf_api, tf_version

    return tf_version(), tf_api(tf_version())


def test_json_is_only_json_and_names_this_legs_tensorflow(run_cli, tf_version):
    done = run_cli("--json", "--devices", "/cpu:0", "/cpu:1", "--backend", "nccl,reduce_to_cpu")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["tf_version"], report["tf_api"]) == tf_version
    assert report["backend"] == "reduce_to_cpu"
    assert report["mode"] == "list"
    assert report["devices"] == ["/device:CPU:0", "/device:CPU:1"]
    nccl = report["candidates"][0]
    assert nccl["status"] == "failed"
    assert "NcclAllReduce" in nccl["reason"]
    assert set(nccl) == {"name", "status", "reason", "seconds", "cached", "remedy", "ms"}


def test_text_shows_each_candidate_as_it_completes_then_the_table(run_cli):
    done = run_cli("--devices", "/cpu:0", "/cpu:1", "/cpu:2")
    assert done.returncode == 0, done.stderr
    progress, table = done.stdout.split("\n\n", 1)
    lines = {line.split()[0]: line.split()[1] for line in progress.splitlines()[1:]}
    assert (lines["hierarchical_copy"], lines["reduce_to_cpu"]) == ("failed", "ok")
    assert table.startswith("backend      ") and "(auto, chosen by default)" in table
    assert "nccl               skipped" in table
    assert cli.ONE_DEVICE_NEXT not in done.stdout  # said of one device only


def test_one_device_says_nothing_was_checked_and_how_to_watch_the_checks(run_cli):
    one = run_cli("--devices", "/cpu:0")
    assert one.returncode == 0, one.stderr
    assert one.stdout.rstrip().endswith(cli.ONE_DEVICE_NEXT)  # never for more: the test above


def test_exit_1_when_nothing_works(run_cli):
    done = run_cli("--json", "--devices", "/cpu:0", "/cpu:1", "/cpu:2", "--backend", "nccl")
    assert done.returncode == 1
    assert json.loads(done.stdout)["candidates"][0]["status"] == "failed"


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--backend", "ncll"], {}, "unknown name 'ncll'"),
        (["--timeout", "1e10"], {}, "up to 86400"),
        ([], {"SAFESTRATEGY_CACHE": "maybe"}, "SAFESTRATEGY_CACHE"),
        (["--refresh", "--no-cache"], {}, "not allowed with argument"),
        (["--devices", "/gpu:0", "/gpu:1"], {}, "do not exist in this process"),
        ([], {"SAFESTRATEGY_BACKEND": "nccl;reduce_to_cpu"}, "SAFESTRATEGY_BACKEND"),
        ([], {"SAFESTRATEGY_PROBE_TIMEOUT": "-3"}, "SAFESTRATEGY_PROBE_TIMEOUT"),
        (["--devices", "gpu"], {}, "not a local device name"),
        (["--timeout", "soon"], {}, "invalid float value"),
    ],
)
def test_exit_2_on_bad_arguments_or_environment(run_cli, args, env, message):
    done = run_cli(*args, env=env)
    assert done.returncode == 2
    assert message in done.stderr
    assert done.stdout == ""  # only the error: no "checking ..." before it


def test_the_report_shows_cached_verdicts_and_refresh_checks_again(fake, capsys):
    from safestrategy import cli

    fake("ok")
    args = ["--devices", "/cpu:0", "/cpu:1", "--backend", "nccl"]
    assert cli.main(args) == 0
    assert capsys.readouterr().out.startswith("checking all-reduce backends...\n")
    safestrategy_decisions_clear()
    assert cli.main(args) == 0
    assert "  nccl               ok         cached  all 2 replicas" in capsys.readouterr().out
    safestrategy_decisions_clear()
    assert cli.main([*args, "--refresh"]) == 0
    assert " cached " not in capsys.readouterr().out
    safestrategy_decisions_clear()
    assert cli.main([*args, "--no-cache"]) == 0
    assert len(fake.starts()) == 3


def safestrategy_decisions_clear():
    """What a new ``python -m safestrategy`` process would remember: nothing."""
    from safestrategy import factory

    factory._decisions.clear()


def test_records_lists_and_forgets_both_key_spaces_with_tf_config_set(run_cli, tf, tmp_path):
    """``python -m safestrategy records``: one-machine and multi-worker records alike, on a
    worker (TF_CONFIG set), where ``--devices ... --refresh`` is for one machine (exit 2)."""
    from safestrategy import records

    records.record(records.on_machine(tf, ["/device:CPU:0", "/device:CPU:1"]), "nccl", 601, {})
    worker = records.on_worker(tf, ["127.0.0.1:2222", "127.0.0.1:2223"], "worker:1")
    records.record(worker, "ring", 602, {})
    tf_config = json.dumps(
        {
            "cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
            "task": {"type": "worker", "index": 1},
        }
    )
    on_worker = {"TF_CONFIG": tf_config}
    listed = run_cli("records", env=on_worker)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith("2 records in ")
    assert "nccl" in listed.stdout and "one machine, /device:CPU:0, /device:CPU:1" in listed.stdout
    assert "ring" in listed.stdout and "multi-worker, worker:1 of 127.0.0.1:2222" in listed.stdout
    assert run_cli("--devices", "/cpu:0", "/cpu:1", "--refresh", env=on_worker).returncode == 2
    forgot = run_cli("records", "--forget", "--backend", "ring", env=on_worker)
    assert forgot.stdout.startswith("forgot 1 record in ")
    assert run_cli("records").stdout.startswith("1 record in ")
    assert "not read by any decision here" not in run_cli("records").stdout
    old = dict(records.on_machine(tf, ["/device:CPU:0", "/device:CPU:1"]).key, tf="2.16.2")
    records.record(records.Place(records.KIND, old, True), "nccl", 603, {})
    unread = run_cli("records").stdout.splitlines()
    assert unread[0].startswith("2 records in ")
    assert (
        f"    not read by any decision here (written on TF 2.16.2, this is {tf.__version__}): "
        "`records --forget` forgets it" in unread
    )
    assert run_cli("records", "--backend", "bogus").returncode == 2
    assert run_cli("records", env={"SAFESTRATEGY_CACHE": "maybe"}).returncode == 2


def test_the_command_the_report_quotes_for_recorded_stalls_forgets_them(run_cli, tf):
    """The report's "stalls recorded (... forgets them)" quotes a command that does: it
    names the devices, which the records' key holds (a bare --refresh checks the default
    devices and leaves them)."""
    from safestrategy import records

    records.record(records.on_machine(tf, ["/device:CPU:0", "/device:CPU:1"]), "nccl", 601, {})
    shown = run_cli("--devices", "/cpu:0", "/cpu:1")
    assert shown.returncode == 0, shown.stderr
    (quoted,) = re.findall(r"stalls recorded \(`?(.+?)`? forgets them\)", shown.stdout)
    ran = subprocess.run(
        shlex.split(quoted),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        universal_newlines=True,
        cwd=str(ROOT),
        timeout=600,
    )
    assert ran.returncode == 0, ran.stderr
    assert run_cli("records").stdout.startswith("0 records in ")
    assert "stalls recorded" not in run_cli("--devices", "/cpu:0", "/cpu:1").stdout


def test_records_says_which_cache_directory_it_read_and_that_it_is_only_that_one(run_cli, tmp_path):
    """``records`` reads one cache directory, not the machine: its output and help name it
    and the variable that chooses another."""
    where = str(tmp_path / "cache")  # the isolated fixture's SAFESTRATEGY_CACHE_DIR
    listed = run_cli("records")
    assert (
        listed.stdout == f"0 records in the cache directory {where} (from SAFESTRATEGY_CACHE_DIR)\n"
    )
    forgot = run_cli("records", "--forget").stdout
    assert (
        forgot == f"forgot 0 records in the cache directory {where} (from SAFESTRATEGY_CACHE_DIR)\n"
    )
    unset = run_cli("records", env={"SAFESTRATEGY_CACHE_DIR": "", "XDG_CACHE_HOME": str(tmp_path)})
    assert unset.stdout == (
        f"0 records in the cache directory {tmp_path / 'safestrategy'} (the user cache "
        "directory; SAFESTRATEGY_CACHE_DIR names another)\n"
    )
    helped = run_cli("records", "--help").stdout
    assert "one cache directory" in helped and "every record on" not in helped
    assert where in " ".join(helped.split())
    assert "in the cache directory (SAFESTRATEGY_CACHE_DIR)" in run_cli("--help").stdout


def test_help_lists_every_variable_a_user_sets_with_its_default(run_cli):
    """Every SAFESTRATEGY_ variable the library reads from a user (not the ones ``run``
    sets for its launches) is in ``--help``; ``--timeout`` and ``--refresh`` say all."""
    helped = " ".join(run_cli("--help").stdout.split())
    set_by_run = {_env.ENV_RUN_DIR, _env.ENV_RESTART, _env.ENV_RUN_GRACE}
    names = {
        value
        for name, value in vars(_env).items()
        if name.startswith("ENV_") and value.startswith("SAFESTRATEGY_")
    }
    assert len(names - set_by_run) == 11
    assert [name for name in sorted(names - set_by_run) if name not in helped] == []
    assert f"seconds per smoke check (default {_env.DEFAULT_TIMEOUT:g}" in helped
    assert f"(default {_env.DEFAULT_STALL_TIMEOUT:g}; off)" in helped
    assert "every candidate is timed again" in helped and "stall and crash records" in helped


def test_run_help_shows_its_defaults_and_what_grace_bounds(run_cli):
    helped = " ".join(run_cli("run", "--help").stdout.split())
    assert "relaunches after the first launch (default: 3)" in helped
    assert "after Ctrl-C" in helped and "finished" in helped
    assert "between SIGTERM and SIGKILL (default: 30)" in helped
