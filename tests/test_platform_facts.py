"""Platforms as facts (issue 31, items 6 and 7): the build of torch (CUDA, ROCm, CPU) read
without importing it, the driver's CUDA against the build's, NUMA, AMD GPUs, the CUDA
forward-compatibility driver, the ephemeral ports, Apple silicon; and what the planner does
with each, plus the signatures and remedies of the texts that go with them. Every assertion is
on data: facts, rule ids and effects, trace events, causes, candidate keys."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from resilient_strategy.core.knowledge.clauses import fact_values
from resilient_strategy.core.knowledge.rules import fired, load_rules
from resilient_strategy.core.knowledge.signatures import builtin_signatures
from resilient_strategy.core.measures.probe import ENVIRONMENTAL_CAUSES, ProbeSpec
from resilient_strategy.core.trace.event import Note
from resilient_strategy.core.trace.inputs import FactsSeen
from resilient_strategy.core.trace.ruling import RemedyQueued, RuleFired
from resilient_strategy.core.values.facts import Facts, FrameworkInfo, Gpu
from resilient_strategy.deciding.cache import refusal
from resilient_strategy.machine import host
from resilient_strategy.machine.versions import detect_frameworks, local_build
from resilient_strategy.run.verdicts import classify_error
from resilient_strategy.testing import FakeProber, machine, simulate

RULES = load_rules()
LAUNCH2 = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
TWO_NODES = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
             "GROUP_RANK": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _ids(facts: Facts, framework: str = "torch") -> set[str]:
    return {r.id for r in fired(RULES, facts, framework)}


# ----- the build of torch -----------------------------------------------------------------------
@pytest.mark.parametrize(("version", "expected"), [
    ("2.8.0+cu128", ("12.8", None)), ("2.1.0+cu118", ("11.8", None)),
    ("2.5.1+rocm6.2", (None, "6.2")), ("2.4.0+rocm6.1.3", (None, "6.1.3")),
    ("2.5.1+cpu", (None, None)), ("2.5.1", (None, None)),
])
def test_the_wheel_tag_names_the_build(version: str, expected: tuple[str | None, str | None]
                                       ) -> None:
    assert local_build(version) == expected


class _Packages:
    def __init__(self, version: str, folder: str) -> None:
        self.dist = SimpleNamespace(version=version, requires=[])
        self.folder = folder

    def distribution(self, name: str) -> Any:
        if name == "torch":
            return self.dist
        import importlib.metadata
        raise importlib.metadata.PackageNotFoundError(name)

    def version(self, name: str) -> str:
        import importlib.metadata
        raise importlib.metadata.PackageNotFoundError(name)

    def package_dir(self, name: str) -> str | None:
        return self.folder if name == "torch" else None


def test_a_rocm_torch_is_a_rocm_build_not_a_cpu_only_one(tmp_path: Path) -> None:
    folder = tmp_path / "torch"
    _write(folder / "version.py", "__version__ = '2.5.1+rocm6.2'\ncuda = None\n"
           "hip = '6.2.41133-dd7f95766'\n")
    torch = detect_frameworks({}, _Packages("2.5.1+rocm6.2", str(folder)))[0]
    assert (torch.cuda, torch.hip, torch.build) == (None, "6.2.41133-dd7f95766", "rocm")
    # the tag alone says it where version.py is unreadable
    bare = detect_frameworks({}, _Packages("2.5.1+rocm6.2", str(tmp_path / "none")))[0]
    assert (bare.hip, bare.build) == ("6.2", "rocm")
    cuda = detect_frameworks({}, _Packages("2.8.0+cu128", str(tmp_path / "none")))[0]
    assert (cuda.cuda, cuda.build) == ("12.8", "cuda")
    assert FrameworkInfo("torch", "2.5.1+cpu").build == "cpu"
    assert FrameworkInfo("torch").build == ""


def test_rocm_is_named_and_planned_on_the_cpu_with_its_unsupported_line() -> None:
    rocm = machine(0, torch="2.5.1+rocm6.2", torch_cuda=None, torch_nccl=None,
                   torch_hip="6.2.41133", amd_gpus=8)
    sel = simulate(rocm, framework="torch", global_batch_size=64)
    assert sel.backend == "cpu"
    assert "rocm-build-unsupported" in sel.plan.rules_fired
    seen = next(e for e in sel.plan.events if isinstance(e, FactsSeen))
    assert seen.hip == "6.2.41133" and seen.cuda is None
    # NVIDIA GPUs next to a ROCm build: unusable from it, and said as a ROCm build
    mixed = machine(2, torch="2.5.1+rocm6.2", torch_cuda=None, torch_nccl=None,
                    torch_hip="6.2", env=LAUNCH2)
    p = simulate(mixed, framework="torch", global_batch_size=64).plan
    topics = [e.topic for e in p.events if isinstance(e, Note)]
    assert "rocm_build" in topics and "cpu_only_build" not in topics


def test_apple_silicon_is_one_mps_device_and_plans_the_cpu() -> None:
    mac = machine(0, platform="darwin", cpu_arch="arm64", torch="2.5.1", torch_cuda=None,
                  torch_nccl=None)
    assert fact_values(mac, "torch")["host.mps"] is True
    assert fact_values(machine(0, platform="darwin", cpu_arch="x86_64"), "torch")["host.mps"] \
        is False
    sel = simulate(mac, framework="torch", global_batch_size=64)
    assert sel.backend == "cpu" and "mps-one-device" in sel.plan.rules_fired
    several = simulate(mac, framework="torch", global_batch_size=64, env=LAUNCH2)
    assert several.backend == "gloo" and not several.devices  # gloo between CPU processes


# ----- the driver's CUDA against the build's ----------------------------------------------------
def test_a_driver_of_an_older_cuda_major_plans_without_the_gpus_before_any_probe() -> None:
    old = machine(4, driver="570.86.15", driver_cuda="12.8", torch_cuda="13.0", env={
        "WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"})
    assert fact_values(old, "torch")["driver.cuda_major_behind"] is True
    prober = FakeProber({"*": "ok"})
    sel = simulate(old, prober, framework="torch", global_batch_size=64)
    assert sel.backend == "gloo" and sel.devices == ()  # CPU processes, never a GPU candidate
    assert all(not c.devices for c in sel.plan.candidates)
    assert [k for k in sel.results if ":nccl:" in k] == [] and prober.health_checks == []
    act = [e.action for e in sel.plan.events if isinstance(e, RuleFired)
           and e.rule == "driver-cuda-major-older-than-build"]
    assert act == ["no_gpu"]


def test_minor_version_compatibility_warns_and_probes() -> None:
    minor = machine(2, driver="535.129.03", driver_cuda="12.2", torch_cuda="12.4", env=LAUNCH2)
    assert _ids(minor) >= {"driver-older-than-cuda-build"}
    assert "driver-cuda-major-older-than-build" not in _ids(minor)
    sel = simulate(minor, FakeProber({"*": "ok"}), framework="torch", global_batch_size=64)
    assert sel.backend == "nccl"
    # a forward-compatibility driver in the image lets a newer major run: no verdict before a
    # probe, and on a consumer card the 804 it gives there is named
    compat = machine(2, name="NVIDIA GeForce RTX 4090", cc=(8, 9), driver_cuda="12.2",
                     torch_cuda="13.0", cuda_compat="580.65.06", env=LAUNCH2)
    assert "driver-cuda-major-older-than-build" not in _ids(compat)
    assert "cuda-forward-compat-on-unsupported-gpu" in _ids(compat)
    dc = machine(2, driver_cuda="12.2", torch_cuda="13.0", cuda_compat="580.65.06")
    assert "cuda-forward-compat-on-unsupported-gpu" not in _ids(dc)
    # CUDA images carry the compat libraries even where the host driver is new enough (seen on
    # an H200 host: /usr/local/cuda-13.0/compat under driver 580.159.04): nothing to say then
    newer = machine(2, name="NVIDIA GeForce RTX 4090", cc=(8, 9), driver_cuda="13.0",
                    torch_cuda="13.0", cuda_compat="580.95.05")
    assert "cuda-forward-compat-on-unsupported-gpu" not in _ids(newer)


# ----- host layout, read from files -------------------------------------------------------------
def test_numa_kfd_compat_and_ports_read_from_a_tree(tmp_path: Path) -> None:
    node = tmp_path / "sys/devices/system/node"
    _write(node / "node0/cpulist", "0-31\n")
    _write(node / "node0/meminfo", "Node 0 MemTotal:       263856940 kB\n")
    _write(node / "node1/cpulist", "32-63\n")
    _write(node / "node1/meminfo", "Node 1 MemTotal:       264240580 kB\n")
    _write(node / "node2/cpulist", "\n")  # a memory-only node (CXL, HBM, Grace's GPU memory)
    _write(node / "node2/meminfo", "Node 2 MemTotal:       100663296 kB\n")
    _write(node / "possible", "0-2\n")  # not a node
    kfd = tmp_path / "sys/class/kfd/kfd/topology/nodes"
    _write(kfd / "0/properties", "cpu_cores_count 64\nsimd_count 0\n")
    for n in (1, 2):
        _write(kfd / f"{n}/properties", "cpu_cores_count 0\nsimd_count 304\ngfx_target_version 90402\n")
    _write(tmp_path / "usr/local/cuda-12.4/compat/libcuda.so.550.54.15", "")
    _write(tmp_path / "usr/local/cuda-12.4/compat/libcuda.so.1", "")
    _write(tmp_path / "proc/sys/net/ipv4/ip_local_port_range", "32768\t60999\n")
    _write(tmp_path / "sys/bus/pci/devices/0000:3b:00.0/numa_node", "1\n")
    _write(tmp_path / "sys/bus/pci/devices/0000:3c:00.0/numa_node", "-1\n")
    h = host.detect_host({}, str(tmp_path))
    assert (h.numa_nodes, h.numa_memory_only, h.amd_gpus) == (3, 1, 2)
    assert (h.cuda_compat, h.port_range) == ("550.54.15", "32768-60999")
    assert host.gpu_numa_node(str(tmp_path), "00000000:3B:00.0") == 1
    assert host.gpu_numa_node(str(tmp_path), "00000000:3C:00.0") is None  # -1: none known
    assert host.gpu_numa_node(str(tmp_path), "garbage") is None
    empty = host.detect_host({}, str(tmp_path / "empty"))
    assert (empty.numa_nodes, empty.amd_gpus, empty.cuda_compat, empty.port_range) == (
        None, None, "", "")


def test_the_gpus_numa_nodes_are_a_fact_rules_read() -> None:
    f = machine(4, gpu_numa=[0, 0, 1, 1], numa_nodes=2)
    assert [g.numa_node for g in f.gpus] == [0, 0, 1, 1]
    values = fact_values(f, "torch")
    assert (values["gpus.numa_nodes"], values["host.numa_nodes"]) == (2, 2)
    assert fact_values(machine(2), "torch")["gpus.numa_nodes"] is None  # unknown
    # the JSON form carries it both ways
    assert Facts.from_dict(f.to_dict()).gpus[2].numa_node == 1
    assert Gpu(0, "x", (9, 0)).numa_node is None


# ----- texts -> causes -> what is done ----------------------------------------------------------
@pytest.mark.parametrize(("text", "cause"), [
    ("RuntimeError: [enforce fail at ../third_party/gloo/gloo/transport/tcp/device.cc:276] "
     "ss1.ss_family == ss2.ss_family. 2 vs 10", "gloo_address_family"),
    ("RuntimeError: CUDA error: invalid device ordinal", "invalid_ordinal"),
    ("node2:24881:25568 [2] include/alloc.h:178 NCCL WARN Cuda failure 'out of memory'",
     "nccl_oom"),
    ("misc/cudawrap.cc NCCL WARN Cuda failure in ncclCuMemHostEnable", "numa_host_alloc"),
    ("gloo/transport/tcp/pair.cc:761] connect [::1]:8355: Connection refused",
     "loopback_refused"),
    ("gloo/transport/tcp/pair.cc:761] connect [127.0.1.1]:60817: Connection refused",
     "gloo_connection"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom"),
])
def test_signatures_place_the_texts(text: str, cause: str) -> None:
    assert builtin_signatures().classify(text) == cause


def _cpu_nodes(ifname: str) -> Facts:
    """Two nodes of one CPU process each, MASTER_ADDR routed through ``ifname``."""
    return machine(0, torch_cuda=None, torch_nccl=None, env=TWO_NODES,
                   platform_facts={"master_ifname": ifname})


def test_an_address_family_mismatch_is_placed_and_gets_no_interface_remedy() -> None:
    # no variable of gloo's fixes it (gloo#399: a code change, gloo#503): placed, said, and the
    # job goes on without gloo rather than spending probes on interfaces
    f = _cpu_nodes("eth0")
    prober = FakeProber({"gloo": "fails:[enforce fail at gloo/transport/tcp/device.cc:276] "
                                 "ss1.ss_family == ss2.ss_family. 2 vs 10", "gloo+*": "ok"})
    sel = simulate(f, prober, framework="torch", global_batch_size=64)
    assert sel.backend == "cpu" and prober.probed == ["gloo"]
    assert [r.cause for k, r in sel.results.items() if not r.ok] == ["gloo_address_family"]


def test_loopback_refused_on_one_machine_is_not_blamed_on_an_interface() -> None:
    refused = ("fails:Gloo connectFullMesh failed with [gloo/transport/tcp/pair.cc:152] timed "
               "out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:29501")
    one = simulate(machine(0, torch_cuda=None, torch_nccl=None), FakeProber({"gloo": refused}),
                   framework="torch", global_batch_size=64, env=LAUNCH2)
    gloo = next(r for k, r in one.results.items() if ":gloo:" in k)
    assert gloo.cause == "loopback_refused" and one.backend == "cpu"
    assert not [e for e in one.plan.events if isinstance(e, RemedyQueued)]  # no interface tried
    # between nodes the same words are a rank that advertised its loopback: the interface
    two = simulate(_cpu_nodes("ens5"), FakeProber({"gloo": refused, "gloo+*": "ok"}),
                   framework="torch", global_batch_size=64)
    assert two.backend == "gloo" and dict(two.env).get("GLOO_SOCKET_IFNAME") == "ens5"


def test_a_shm_failure_on_a_numa_host_tries_nccl_host_buffers_from_dev_shm_first() -> None:
    shm = "fails:NCCL WARN Error while attaching to shared memory segment /dev/shm/nccl- (size 0)"
    numa = machine(2, torch_nccl="2.27.3", numa_nodes=2, gpu_numa=[0, 1], env=LAUNCH2)
    sel = simulate(numa, FakeProber({"nccl": shm, "nccl+*": "ok"}), framework="torch",
                   global_batch_size=64)
    assert dict(sel.env) == {"NCCL_CUMEM_HOST_ENABLE": "0"}
    queued = [e.remedy for e in sel.plan.events if isinstance(e, RemedyQueued)]
    assert queued[:2] == ["cumem-host-off-numa", "shm-off"]
    # one NUMA node (or a small /dev/shm): /dev/shm is the suspect, NUMA is not tried
    flat = machine(2, torch_nccl="2.27.3", numa_nodes=1, env=LAUNCH2)
    sel = simulate(flat, FakeProber({"nccl": shm, "nccl+*": "ok"}), framework="torch",
                   global_batch_size=64)
    assert dict(sel.env) == {"NCCL_SHM_DISABLE": "1"}
    # NCCL's own words for a NUMA-pinned allocation: the remedy alone
    own = simulate(numa, FakeProber({"nccl": "fails:NCCL WARN Cuda failure in ncclCuMemHostEnable",
                                     "nccl+*": "ok"}), framework="torch", global_batch_size=64)
    assert dict(own.env) == {"NCCL_CUMEM_HOST_ENABLE": "0"}


class _OomFirst(FakeProber):
    """Plain NCCL runs out of GPU memory setting up ``fails`` times, then passes."""

    fails = 1
    plain_calls = 0

    def __call__(self, spec: ProbeSpec, env: Any) -> Any:
        if spec.backend == "nccl" and not spec.env:
            self.plain_calls += 1
            if self.plain_calls <= self.fails:
                return FakeProber({"*": "fails:include/alloc.h:178 NCCL WARN Cuda failure "
                                        "'out of memory'"})(spec, env)
        return super().__call__(spec, env)


def test_nccl_out_of_memory_at_init_is_checked_and_retried_not_a_verdict() -> None:
    prober = _OomFirst({"*": "ok"})
    sel = simulate(machine(2, env=LAUNCH2), prober, framework="torch", global_batch_size=64)
    assert sel.backend == "nccl" and prober.plain_calls == 2
    assert prober.health_checks == [(0, 1)]  # the GPUs checked between the two tries
    notes = [e for e in sel.plan.events if isinstance(e, Note) and e.topic == "retried_after_check"]
    assert len(notes) == 1


def test_nccl_out_of_memory_twice_rules_out_for_this_run_only() -> None:
    prober = _OomFirst({"*": "ok"})
    prober.fails = 2
    sel = simulate(machine(2, env=LAUNCH2), prober, framework="torch", global_batch_size=64)
    assert prober.plain_calls == 2 and sel.backend != "nccl"  # tried twice, then the next rung
    failed = sel.results["torch:nccl:0,1"]
    assert failed.cause == "nccl_oom" and "nccl_oom" in ENVIRONMENTAL_CAUSES
    assert refusal(failed) is not None  # never cached: the GPU's memory, not NCCL
    # a wedged GPU found by the check ends the decision, as after a hang
    broken = _OomFirst({"*": "ok"}, broken_gpus={1: "did not initialize"})
    from resilient_strategy.errors import GpuUnusableError
    with pytest.raises(GpuUnusableError):
        simulate(machine(2, env=LAUNCH2), broken, framework="torch", global_batch_size=64)


def test_mid_run_nccl_out_of_memory_stays_an_oom_verdict() -> None:
    text = "ncclUnhandledCudaError: Call to CUDA function failed. NCCL WARN Cuda failure 'out of memory'"
    assert classify_error(["torch.distributed.DistBackendError", "RuntimeError"], text) == "oom"


def test_a_master_port_inside_the_ephemeral_range_is_named() -> None:
    inside = machine(2, port_range="32768-60999", env={**LAUNCH2, "MASTER_PORT": "57062"})
    assert fact_values(inside, "torch")["host.master_port_ephemeral"] is True
    assert "master-port-in-ephemeral-range" in _ids(inside)
    below = machine(2, port_range="32768-60999", env={**LAUNCH2, "MASTER_PORT": "29500"})
    assert "master-port-in-ephemeral-range" not in _ids(below)
    unknown = machine(2, env={**LAUNCH2, "MASTER_PORT": "57062"})  # the range unread
    assert fact_values(unknown, "torch")["host.master_port_ephemeral"] is None


def test_an_invalid_device_ordinal_is_the_launch_not_the_backend() -> None:
    table = builtin_signatures()
    text = "RuntimeError: CUDA error: invalid device ordinal"
    assert table.blame.script_fault(text, False) is not None  # the script's (its launch)
    assert table.blame.script_fault(text, True) is None  # inside NCCL's init: not said
