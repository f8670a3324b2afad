"""Where the cluster comes from: a resolver, TF_CONFIG, a Slurm step (pure, no TensorFlow)."""

import json

import pytest

from safestrategy import _env
from safestrategy.multiworker import cluster, factory, slurm

STEP = {
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_NODELIST": "node[9-10]",
    "SLURM_STEP_TASKS_PER_NODE": "2,1",
    "SLURM_PROCID": "2",
    "SLURMD_NODENAME": "node10",
    "SLURM_JOB_ID": "412",
    "SLURM_STEP_ID": "0",
    "SLURM_NTASKS": "3",
}


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node[9-10]", ["node9", "node10"]),  # Slurm's order, not sorted as text
        ("n[08-10],login", ["n08", "n09", "n10", "login"]),
        ("a[1,3-4]b", ["a1b", "a3b", "a4b"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
        ("vm", ["vm"]),
    ],
)
def test_host_lists_expand_in_slurms_own_order(text, hosts):
    assert slurm.expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["", "n[1-", "n[3-1]", "n[a]", "n]1["])
def test_a_bad_host_list_is_a_value_error_quoting_it(text):
    with pytest.raises(ValueError, match="host list"):
        slurm.expand_hostlist(text)


def test_tasks_per_node_expand_repeats():
    assert slurm.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="N or N"):
        slurm.expand_tasks_per_node("2(x)")


def test_the_port_formula_keeps_a_jobs_concurrent_steps_apart_and_below_ephemeral_ports():
    for job in (1, 412, 999_999, 2**31):
        windows = [slurm.port_base(job, step) for step in range(slurm.STEPS_PER_JOB)]
        spans = [set(range(base, base + slurm.WINDOW)) for base in windows]
        assert all(a.isdisjoint(b) for i, a in enumerate(spans) for b in spans[i + 1 :])
        assert all(base >= slurm.FIRST_PORT and base + slurm.WINDOW - 1 < 32768 for base in windows)
    assert slurm.port_base(412, 0) != slurm.port_base(413, 0)


def test_a_step_of_three_tasks_on_two_nodes_is_block_laid_out_with_consecutive_ports():
    step = slurm.read(STEP, None)
    base = slurm.port_base(412, 0)
    assert step.tasks == (("node9", base), ("node9", base + 1), ("node10", base))
    found = cluster.from_slurm(step)
    assert found.task == "worker:2" and found.me.host == "node10"
    assert (found.source, found.origin) == ("slurm", "Slurm job 412 step 0")
    assert "port formula for job 412 step 0" in found.ports


def test_the_port_base_setting_is_used_and_validated():
    step = slurm.read(STEP, _env.resolve_port_base({_env.ENV_PORT_BASE: "20000"}))
    assert [port for _, port in step.tasks] == [20000, 20001, 20000]
    assert step.ports == "SAFESTRATEGY_PORT_BASE=20000"
    for bad in ("80", "65536", "2e4", "-1"):
        with pytest.raises(ValueError, match="SAFESTRATEGY_PORT_BASE"):
            _env.resolve_port_base({_env.ENV_PORT_BASE: bad})


@pytest.mark.parametrize(
    "change, words",
    [
        ({"SLURM_DISTRIBUTION": "cyclic"}, "block"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x2)"}, "does not add up"),
        ({"SLURMD_NODENAME": "node9"}, "runs on node9"),
        ({"SLURM_PROCID": "3"}, "not a task"),
        ({"SLURM_JOB_ID": ""}, "SLURM_JOB_ID"),
    ],
)
def test_a_step_that_cannot_be_read_as_workers_says_why(change, words):
    with pytest.raises(ValueError, match=words):
        slurm.read({**STEP, **change}, None)


def test_one_task_per_node_takes_any_distribution():
    one_each = {**STEP, "SLURM_STEP_TASKS_PER_NODE": "1(x3)", "SLURM_STEP_NODELIST": "n[1-3]"}
    one_each.update(SLURMD_NODENAME="n3", SLURM_DISTRIBUTION="cyclic")
    assert slurm.read(one_each, None).tasks[2][0] == "n3"


def test_a_batch_script_or_a_one_task_step_is_no_cluster():
    job_only = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")}
    assert cluster.find(None, job_only) is None  # SLURM_NTASKS=3 alone: one process
    assert cluster.find(None, {**STEP, "SLURM_STEP_NUM_TASKS": "1"}) is None
    said = factory.no_cluster({"SLURM_STEP_NUM_TASKS": "1"})
    assert "cluster_resolver=" in said and "TF_CONFIG" in said and "Slurm" in said
    assert "one task" in said and "auto_strategy()" in said


class Spec:
    def __init__(self, jobs):
        self.jobs = jobs

    def as_dict(self):
        return self.jobs


class Resolver:
    """The three things make_multiworker_strategy() asks of a ClusterResolver."""

    def __init__(self, jobs, task_type="worker", task_id=0):
        self.spec, self.task_type, self.task_id = Spec(jobs), task_type, task_id

    def cluster_spec(self):
        return self.spec


def test_a_resolver_comes_before_tf_config_and_slurm():
    config = {"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}}
    environ = {**STEP, "TF_CONFIG": json.dumps(config)}
    resolver = Resolver({"chief": ["c:3"], "worker": {1: "w1:5", 0: "w0:4"}}, "worker", 1)
    found = cluster.find(resolver, environ)
    assert [str(a) for a in found.workers] == ["c:3", "w0:4", "w1:5"]  # sparse: by index
    assert (found.task, found.source, found.origin) == ("worker:1", "resolver", found.ports)
    assert found.origin == "cluster_resolver=Resolver"
    assert cluster.find(None, environ).task == "worker:1"  # then TF_CONFIG
    assert cluster.find(None, environ).source == "TF_CONFIG"
    assert cluster.find(None, STEP).source == "slurm"


@pytest.mark.parametrize(
    "resolver, words",
    [
        (Resolver({}), 'no "cluster" with'),
        (Resolver({"worker": ["a:1"]}, "worker", 3), "task worker:3 is not in the cluster"),
        (Resolver({"worker": ["a:1"], "ps": ["p:2"]}, "ps", 0), "task type 'ps'"),
    ],
)
def test_a_resolver_that_returns_no_cluster_for_this_process_is_named(resolver, words):
    with pytest.raises(ValueError, match=words) as raised:
        cluster.find(resolver, {})
    assert "cluster_resolver=Resolver returned cluster_spec" in str(raised.value)


def test_tasks_on_one_host_that_see_the_same_gpus_get_one_warning():
    from safestrategy.multiworker import agree

    def hello(host, gpus=1, visible=None):
        return {"host": host, "gpus": gpus, "visible_gpus": visible}

    same = {"worker:0": hello("n1"), "worker:1": hello("n1"), "worker:2": hello("n2")}
    said = agree.shared_gpus(same, "worker:0")
    assert said.startswith("worker:0 and worker:1 run on n1 and see the same GPUs")
    assert "CUDA_VISIBLE_DEVICES unset" in said and "--gpus-per-task=1" in said
    assert agree.shared_gpus(same, "worker:1") is None  # said once, by the first of them
    own = {"worker:0": hello("n1", visible="0"), "worker:1": hello("n1", visible="1")}
    assert agree.shared_gpus(own, "worker:0") is None
    cpus = {"worker:0": hello("n1", gpus=0), "worker:1": hello("n1", gpus=0)}
    assert agree.shared_gpus(cpus, "worker:0") is None
    old = {"worker:0": {"gpus": 1}, "worker:1": {"gpus": 1}}  # 0.5's hellos: no host
    assert agree.shared_gpus(old, "worker:0") is None


def test_a_port_taken_is_an_error_naming_the_port_the_task_and_the_setting():
    import socket

    from safestrategy.multiworker.cluster import Address
    from safestrategy.multiworker.rendezvous import Rendezvous

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        me = Address("worker:1", "127.0.0.1", port)
        with pytest.raises(RuntimeError) as raised:
            Rendezvous(me, [], 1, f"SAFESTRATEGY_PORT_BASE={port - 1}").open()
    said = str(raised.value)
    assert f"port {port}, worker:1's port from SAFESTRATEGY_PORT_BASE={port - 1}" in said
    assert isinstance(raised.value, OSError)  # as before 0.6
