"""The launcher read from the environment (core/values/launcher.py, pure) and the GPUs each local
rank was bound to (core/values/binding.py), then both through the testing kit: SLURM's srun
tasks, with the environment shapes a real slurmd 22.05 gives them (recorded from
``srun -n2 env`` and ``srun -n2 --gpus-per-task=1 env`` on tests/slurm/local_slurm.sh)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from resilient_strategy.core.measures.probe import OK, ProbeResult, ProbeSpec
from resilient_strategy.core.values.binding import bind
from resilient_strategy.core.values.launcher import (
    HostlistError,
    expand_hostlist,
    expand_tasks_per_node,
    launcher_from,
    slurm_port,
)
from resilient_strategy.errors import InvalidOptionError
from resilient_strategy.testing import gpu, machine, simulate

#: What srun -n2 set for task 0 (SLURM 22.05; the variables the launcher reads, and some it
#: must not be misled by).
SRUN_TASK0 = {
    "SLURM_JOB_ID": "2", "SLURM_JOBID": "2", "SLURM_JOB_NAME": "bash", "SLURM_JOB_NODELIST": "vm",
    "SLURM_NODELIST": "vm", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1",
    "SLURM_NTASKS": "2", "SLURM_NPROCS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0", "SLURM_STEPID": "0", "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "vm", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2", "SLURM_GTIDS": "0,1",
    "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1",
}
#: What an sbatch -n2 batch script sees: SLURM_PROCID and SLURM_NTASKS, but no step.
BATCH = {"SLURM_JOB_ID": "4", "SLURM_JOB_NODELIST": "vm", "SLURM_LOCALID": "0",
         "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
         "SLURM_TASKS_PER_NODE": "2"}


def task(rank: int, **extra: str) -> dict[str, str]:
    """srun -n2's environment of task ``rank`` on one node."""
    return {**SRUN_TASK0, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), **extra}


# ----- the node list, as scontrol show hostnames expands it --------------------------------------
@pytest.mark.parametrize(("text", "hosts"), [
    ("vm", ("vm",)),
    ("node[01-03,07],gpu5", ("node01", "node02", "node03", "node07", "gpu5")),
    ("r[1-2]n[1-2]", ("r1n1", "r1n2", "r2n1", "r2n2")),
    ("a[8-11]", ("a8", "a9", "a10", "a11")),
    ("gpu-[098-101].cluster",
     ("gpu-098.cluster", "gpu-099.cluster", "gpu-100.cluster", "gpu-101.cluster")),
    ("n[1],m", ("n1", "m")),
])
def test_hostlist_expands_as_scontrol_does(text: str, hosts: tuple[str, ...]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["n[1-", "n]1[", "n[a-b]", "n[3-1]", "n[[1]]", "n[1-99999999]"])
def test_a_malformed_hostlist_is_refused(text: str) -> None:
    with pytest.raises(HostlistError):
        expand_hostlist(text)


def test_tasks_per_node_run_lengths() -> None:
    assert expand_tasks_per_node("2(x3),1") == (2, 2, 2, 1)
    assert expand_tasks_per_node("4") == (4,)
    with pytest.raises(HostlistError):
        expand_tasks_per_node("2(3)")


# ----- which launcher -----------------------------------------------------------------------------
def test_an_srun_task_is_slurm_with_torchrun_names_derived() -> None:
    la = launcher_from(task(1))
    assert (la.kind, la.rank, la.local_rank, la.world_size, la.local_world_size) == (
        "slurm", 1, 1, 2, 2)
    assert la.derived == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                          "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "vm",
                          "MASTER_PORT": str(slurm_port(2))}
    assert slurm_port(2) == 15002 and slurm_port(1234567) == 19567


def test_many_nodes_rendezvous_on_the_first_host_of_the_step() -> None:
    env = {**task(5), "SLURM_NODEID": "2", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "7",
           "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_STEP_NODELIST": "gpu[07-10]",
           "SLURM_JOB_NODELIST": "gpu[01-10]", "SLURM_JOB_ID": "98765"}
    la = launcher_from(env)
    assert (la.rank, la.world_size, la.local_rank, la.local_world_size, la.node_rank,
            la.nodes) == (5, 7, 1, 2, 2, 4)
    assert (la.master_addr, la.master_port) == ("gpu07", 15000 + 98765 % 10000)
    # the expansion handed in (scontrol's) is the one used
    assert launcher_from(env, lambda _: ("head", "x")).master_addr == "head"


def test_the_users_rendezvous_wins() -> None:
    la = launcher_from(task(0, MASTER_ADDR="10.0.0.9", MASTER_PORT="29555"))
    assert "MASTER_ADDR" not in la.derived and "MASTER_PORT" not in la.derived
    assert (la.master_addr, la.master_port) == ("10.0.0.9", 29555)
    env = la.environment(task(0, MASTER_ADDR="10.0.0.9"))
    assert env["MASTER_ADDR"] == "10.0.0.9" and env["RANK"] == "0"


def test_torchrun_under_srun_and_the_users_rank_win_over_slurm() -> None:
    under = launcher_from(task(1, RANK="3", WORLD_SIZE="8", LOCAL_RANK="3",
                               TORCHELASTIC_RUN_ID="j"))
    assert (under.kind, under.rank, under.world_size, under.derived) == ("torchrun", 3, 8, {})
    assert launcher_from(task(1, RANK="0")).kind == "environment"


def test_a_batch_script_is_one_process_and_plain_python_none() -> None:
    la = launcher_from(BATCH)
    assert (la.kind, la.world_size, la.derived) == ("slurm-batch", 1, {})
    assert launcher_from({"PATH": "/bin"}).kind == "python"


def test_an_unreadable_nodelist_is_a_note_not_a_rendezvous() -> None:
    la = launcher_from(task(0, SLURM_STEP_NODELIST="n[1-"))
    assert la.master_addr is None and "MASTER_ADDR" not in la.derived and la.notes


# ----- the GPUs each local rank trains on ------------------------------------------------------
@pytest.mark.parametrize(("seen", "kind", "trains_on", "ordinals"), [
    ([("A", "B"), ("A", "B")], "shared", ("A", "B"), (0, 1)),        # torchrun
    ([("A",), ("B",)], "per_process", ("A", "B"), (0, 0)),           # --gpus-per-task=1
    ([("A", "B"), ("C", "D")], "per_process", ("A", "C"), (0, 0)),   # --gpus-per-task=2
    ([("A", "B"), ("B",)], "per_process", ("A", "B"), (0, 0)),       # bindings that differ
    ([("A", "B"), ("A",)], "mixed", ("B", "A"), (1, 0)),
    ([("MIG-a", "MIG-b"), ("MIG-c",)], "per_process", ("MIG-a", "MIG-c"), (0, 0)),
])
def test_each_rank_trains_on_a_gpu_of_its_own(seen: list[tuple[str, ...]], kind: str,
                                             trains_on: tuple[str, ...],
                                             ordinals: tuple[int, ...]) -> None:
    b = bind(seen)
    assert (b.kind, b.trains_on, b.ordinals, b.unbound) == (kind, trains_on, ordinals, ())


@pytest.mark.parametrize("seen", [[("A",), ("A",)], [("A", "B"), ("A", "B"), ("B",)],
                                  [("MIG-a", "MIG-b"), ("MIG-a", "MIG-b")]])
def test_two_processes_on_one_physical_gpu_are_unbound(seen: list[tuple[str, ...]]) -> None:
    b = bind(seen)
    assert b.unbound and b.shared


# ----- through the testing kit: one thread per srun task ---------------------------------------
def _ranks(facts: list[Any], envs: list[Mapping[str, str]], prober: Any = None,
           **kw: Any) -> list[Any]:
    """``simulate`` on each (facts, env) at once, one thread per rank; each rank's Selection
    (or the exception it raised)."""
    out: list[Any] = [None] * len(facts)

    def one(i: int) -> None:
        try:
            out[i] = simulate(facts[i], {} if prober is None else prober, env=envs[i],
                              global_batch_size=64, **kw)
        except Exception as exc:  # the test asserts on it
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(facts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def _slurm_gpus(tmp_path: Path, visible: list[str], confined: bool = False,
                gpus: int = 4) -> tuple[list[Any], list[dict[str, str]]]:
    envs = [task(r, XDG_RUNTIME_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES=v)
            for r, v in enumerate(visible)]
    if confined:  # cgroups: each task's NVML lists only its own GPU, as index 0
        facts = [machine([gpu(0, uuid=f"GPU-fake-{r:04d}")], env=e) for r, e in enumerate(envs)]
    else:
        facts = [machine(gpus, env=e) for e in envs]
    return facts, envs


def _bound(sel: Any) -> dict[str, Any]:
    [event] = [e for e in sel.to_dict()["events"] if e["kind"] == "gpus_bound"]
    return event


@pytest.mark.parametrize("confined", [False, True])
def test_one_gpu_per_srun_task_trains_as_one_job(tmp_path: Path, confined: bool) -> None:
    facts, envs = _slurm_gpus(tmp_path, ["0", "0"] if confined else ["0", "1"], confined)
    probed: list[tuple[str, str | None]] = []

    def prober(spec: ProbeSpec, env: Mapping[str, str]) -> ProbeResult:
        probed.append((spec.candidate, env.get("CUDA_VISIBLE_DEVICES")))
        return ProbeResult(spec.candidate, OK, 1.0)

    sels = _ranks(facts, envs, prober=prober)
    assert not [s for s in sels if isinstance(s, Exception)], sels
    if confined:  # no process reaches the other task's GPU: nothing probed, said so
        assert probed == [] and not any(s.proven for s in sels)
        assert all(any(e.get("topic") == "gpus_confined" for e in s.to_dict()["events"])
                   for s in sels)
    else:  # local rank 0 probes the node's two GPUs, named by UUID
        assert probed == [("torch:nccl:0,1", "GPU-fake-0000,GPU-fake-0001")]
    for rank, sel in enumerate(sels):
        assert (sel.backend, sel.num_replicas, sel.launch.rank, sel.launch.world_size) == (
            "nccl", 2, rank, 2)
        assert sel.per_replica_batch_size * sel.num_replicas * sel.accumulation_steps == 64
        assert sel.bound_ordinal == 0  # its own GPU, in its own numbering
        assert _bound(sel)["trains_on"] == ["GPU-fake-0000", "GPU-fake-0001"]
        assert _bound(sel)["binding"] == "per_process"
        assert "CUDA_VISIBLE_DEVICES" not in sel.env
        [seen] = [e for e in sel.to_dict()["events"] if e["kind"] == "launcher_seen"]
        assert (seen["launcher"], seen["rank"], seen["world_size"]) == ("slurm", rank, 2)
        assert seen["master_port"] == slurm_port(2)
    assert list(tmp_path.glob("resilient_strategy/agree-gpus-*")) == []  # cleaned up


def test_per_task_visible_devices_without_a_usable_gpu_still_agree(tmp_path: Path) -> None:
    """srun --gpus-per-task on a node whose GPUs this process cannot use (no driver, a CPU
    build): each task's own CUDA_VISIBLE_DEVICES must not split the agreement in two (found
    against the real slurmd: each rank waited for a decision of its own, 180 s)."""
    envs = [task(r, XDG_RUNTIME_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES=str(r))
            for r in range(2)]
    facts = [machine(0, env=e) for e in envs]
    sels = _ranks(facts, envs, timeout=5)
    assert [(s.backend, s.num_replicas, s.launch.rank) for s in sels] == [
        ("gloo", 2, 0), ("gloo", 2, 1)], sels


def test_two_gpus_per_task_and_gpus_per_node(tmp_path: Path) -> None:
    facts, envs = _slurm_gpus(tmp_path, ["0,1", "2,3"])
    sels = _ranks(facts, envs)
    assert [(_bound(s)["trains_on"], s.bound_ordinal) for s in sels] == [
        (["GPU-fake-0000", "GPU-fake-0002"], 0)] * 2
    facts, envs = _slurm_gpus(tmp_path, ["0,1", "0,1"])  # --gpus-per-node=2: both see both
    sels = _ranks(facts, envs)
    assert [(_bound(s)["binding"], s.bound_ordinal, s.devices) for s in sels] == [
        ("shared", None, (0, 1))] * 2


def test_mig_slices_one_per_task(tmp_path: Path) -> None:
    envs = [task(r, XDG_RUNTIME_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES=f"MIG-fake-0000-{r}")
            for r in range(2)]
    facts = [machine(1, mig={0: 2}, env=e) for e in envs]
    sels = _ranks(facts, envs)
    assert [_bound(s)["trains_on"] for s in sels] == [["MIG-fake-0000-0",
                                                        "MIG-fake-0000-1"]] * 2


def _notes(sel: Any) -> list[str]:
    return [e["topic"] for e in sel.to_dict()["events"] if e["kind"] == "note"]


def test_two_ranks_that_see_the_same_mig_list_fall_back_to_one_slice(tmp_path: Path) -> None:
    """Both tasks see MIG-a,MIG-b (CUDA shows each only MIG-a; NCCL spans no MIG instances):
    before, refused as two ranks on one physical GPU; now rank 0 trains on the slice with 2
    accumulation steps, the global batch kept, and rank 1 has nothing to do."""
    envs = [task(r, XDG_RUNTIME_DIR=str(tmp_path),
                 CUDA_VISIBLE_DEVICES="MIG-fake-0000-0,MIG-fake-0000-1") for r in range(2)]
    facts = [machine(1, mig={0: 2}, env=e) for e in envs]
    sels = _ranks(facts, envs)
    assert not [s for s in sels if isinstance(s, Exception)], sels
    assert [(s.backend, s.devices, s.num_replicas, s.accumulation_steps, s.active)
            for s in sels] == [("single_device", (0,), 1, 2, True),
                               ("single_device", (0,), 1, 2, False)]
    assert all("mig_one_slice" in _notes(s) for s in sels)


def test_mig_slices_one_per_task_train_on_one(tmp_path: Path) -> None:
    """Each task its own slice: still no process group across them (the mig-no-multi-gpu
    rule): rank 0's slice trains, accumulating."""
    envs = [task(r, XDG_RUNTIME_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES=f"MIG-fake-0000-{r}")
            for r in range(2)]
    facts = [machine(1, mig={0: 2}, env=e) for e in envs]
    sels = _ranks(facts, envs)
    assert [(s.backend, s.num_replicas, s.accumulation_steps, s.active) for s in sels] == [
        ("single_device", 1, 2, True), ("single_device", 1, 2, False)]
    assert all("mig-no-multi-gpu" in s.plan.rules_fired for s in sels)


def test_torchrun_over_mig_slices_is_not_refused() -> None:
    """The described torchrun launch (one rank planning on its facts): 2 processes, one MIG
    instance visible: one slice, not 'more processes than GPUs'; whole GPUs still refused."""
    env = {"CUDA_VISIBLE_DEVICES": "MIG-fake-0000-0,MIG-fake-0000-1", "WORLD_SIZE": "2",
           "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
           "TORCHELASTIC_RUN_ID": "t"}
    sel = simulate(machine(1, mig={0: 2}, env=env), {}, env=env, global_batch_size=64)
    assert (sel.backend, sel.accumulation_steps, sel.active) == ("single_device", 2, True)
    assert "mig_one_slice" in _notes(sel)
    whole = {**env, "CUDA_VISIBLE_DEVICES": "0"}
    with pytest.raises(InvalidOptionError):
        simulate(machine(1, env=whole), {}, env=whole, global_batch_size=64)


def test_two_tasks_on_one_physical_gpu_are_refused_by_uuid(tmp_path: Path) -> None:
    facts, envs = _slurm_gpus(tmp_path, ["1", "1"])  # both bound to GPU 1, by mistake
    errors = _ranks(facts, envs)
    assert all(isinstance(e, InvalidOptionError) and e.option == "CUDA_VISIBLE_DEVICES"
               for e in errors), errors


# ----- doctor shows the launcher and the binding ------------------------------------------------
@pytest.mark.parametrize(("visible", "per_task", "trains_on", "ordinal"), [
    ("1", True, "GPU-fake-0001", 0),           # --gpus-per-task=1: task 1 sees its own
    ("0,1", False, "GPU-fake-0001", 1),        # both tasks see both: local rank 1 takes the 2nd
])
def test_doctor_shows_the_launcher_and_the_binding(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str],
                                                  visible: str, per_task: bool, trains_on: str,
                                                  ordinal: int) -> None:
    import json

    from resilient_strategy.cli import main

    described = tmp_path / "srun_task1.json"
    described.write_text(json.dumps({"framework": "torch", "machine": {
        "gpus": 4, "env": task(1, CUDA_VISIBLE_DEVICES=visible)}}))
    assert main(["doctor", "--json", "--simulate", str(described)]) == 0
    data = json.loads(capsys.readouterr().out)
    view = data["binding"]
    assert (view["launcher"]["launcher"], view["launcher"]["rank"],
            view["launcher"]["world_size"]) == ("slurm", 1, 2)
    assert (view["per_task"], view["trains_on"], view["ordinal"]) == (per_task, trains_on, ordinal)
    assert main(["doctor", "--simulate", str(described)]) == 0  # the text says it too
    assert trains_on in capsys.readouterr().out


# ----- srun resilient-strategy run (one task per node; issue 42 item 1) -------------------------

#: Node 1 of `srun -N2 --ntasks-per-node=1 --gpus-per-node=4 resilient-strategy run ...`.
RUN_NODE1 = {
    "SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2",
    "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
    "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "4", "SLURMD_NODENAME": "gpu08",
}


def _run_launch(env: Mapping[str, str], given: frozenset[str] = frozenset()) -> Any:
    from resilient_strategy.core.values.launcher import run_launch

    return run_launch(launcher_from(env), env, given)


def test_srun_run_reads_its_node_options_from_slurm() -> None:
    launch = _run_launch(RUN_NODE1)
    assert (launch.launcher, launch.nnodes, launch.node_rank, launch.master_addr,
            launch.master_port, launch.nproc, launch.refused) == (
        "slurm", 2, 1, "gpu07", slurm_port(1234), 4, False)
    assert launch.sources == {"--nnodes": "SLURM_STEP_TASKS_PER_NODE",
                              "--node-rank": "SLURM_NODEID",
                              "--master-addr": "first host of SLURM_STEP_NODELIST",
                              "--master-port": "15000 + SLURM_JOB_ID % 10000",
                              "--nproc-per-node": "SLURM_GPUS_ON_NODE"}


def test_the_user_s_node_options_win_over_slurm() -> None:
    given = frozenset({"--nnodes", "--node-rank", "--rdzv-endpoint", "--nproc-per-node"})
    launch = _run_launch(RUN_NODE1, given)
    assert (launch.nnodes, launch.node_rank, launch.master_addr, launch.master_port,
            launch.nproc) == (None, None, None, None, None)
    mine = _run_launch({**RUN_NODE1, "MASTER_ADDR": "head", "MASTER_PORT": "29400"},
                       frozenset({"--master-port"}))
    assert (mine.master_addr, mine.master_port, mine.sources["--master-addr"]) == (
        "head", None, "MASTER_ADDR")  # the user's environment too; their --master-port kept


def test_one_node_keeps_a_free_port_and_gpus_per_task_give_the_processes() -> None:
    env = {**SRUN_TASK0, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1",
           "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_GPUS_PER_TASK": "a100:2"}
    launch = _run_launch(env)
    assert (launch.nnodes, launch.node_rank, launch.master_addr, launch.master_port,
            launch.nproc) == (1, 0, None, None, 2)  # one node: run picks a free port itself


@pytest.mark.parametrize(("env", "tasks", "source"), [
    (SRUN_TASK0, 2, "SLURM_STEP_TASKS_PER_NODE"),  # srun -n2 on one node
    ({**RUN_NODE1, "SLURM_STEP_TASKS_PER_NODE": "1,3"}, 3, "SLURM_STEP_TASKS_PER_NODE"),
    ({k: v for k, v in RUN_NODE1.items() if k != "SLURM_STEP_TASKS_PER_NODE"}
     | {"SLURM_NTASKS_PER_NODE": "4"}, 4, "SLURM_NTASKS_PER_NODE"),
])
def test_more_than_one_run_task_per_node_is_refused(env: Mapping[str, str], tasks: int,
                                                    source: str) -> None:
    from resilient_strategy.errors import SrunTasksError
    from resilient_strategy.run.cmdline import srun_launch

    launch = _run_launch(env)
    assert (launch.refused, launch.tasks_per_node, launch.tasks_source) == (True, tasks, source)
    with pytest.raises(SrunTasksError) as exc:
        srun_launch(["--nproc-per-node", "2"], env)
    assert (exc.value.tasks_per_node, exc.value.source, exc.value.option) == (
        tasks, source, "--ntasks-per-node")


@pytest.mark.parametrize("env", [{}, {**SRUN_TASK0, "RANK": "0", "WORLD_SIZE": "2"},
                                 {"SLURM_JOB_ID": "4", "SLURM_NTASKS": "2"}])
def test_no_srun_task_reads_nothing(env: Mapping[str, str]) -> None:
    launch = _run_launch(env)  # plain, torchrun's or the user's ranks, a batch script
    assert (launch.nnodes, launch.nproc, launch.refused, launch.words()) == (
        None, None, False, "")


def test_run_s_command_line_under_srun(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Through run's own parser (torchrun's): SLURM's values where the user gave none."""
    from resilient_strategy.run.cmdline import options_from_args

    script = tmp_path / "train.py"
    script.write_text("import torch\n")
    for k, v in RUN_NODE1.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PATH", "")  # no scontrol: the pure node list parser
    opts = options_from_args([str(script)])
    ns = opts.torchrun
    assert (ns.nnodes, ns.node_rank, ns.master_addr, ns.master_port, opts.nproc) == (
        "2", 1, "gpu07", slurm_port(1234), 4)
    assert opts.run_launch.launcher == "slurm"
    opts = options_from_args(["--nproc_per_node=1", "--node-rank", "0", str(script)])
    assert (opts.nproc, opts.torchrun.node_rank, opts.torchrun.nnodes) == (1, 0, "2")
