from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _fake_nvml import (
    GPU_IS_LOST,
    NVMLError,
    a100_mig,
    a6000x4,
    failing,
    h200x2,
    no_driver,
    rtx5090x2,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient_strategy.core.values.facts import Link
from resilient_strategy.machine.nvml import NO_NVIDIA_DEVICE, nvidia_present, read_nvml


def test_h200x2_matches_the_recording() -> None:
    nv = h200x2()
    snap = read_nvml(nv)
    assert snap.error is None
    assert snap.driver_version == "580.159.04"
    assert snap.cuda_driver_version == "13.0"
    assert [(g.index, g.name, g.compute_capability, g.memory_bytes) for g in snap.gpus] == [
        (0, "NVIDIA H200", (9, 0), 150754820096),
        (1, "NVIDIA H200", (9, 0), 150754820096),
    ]
    assert [g.pci_bus_id for g in snap.gpus] == ["00000000:00:06.0", "00000000:00:07.0"]
    assert snap.gpus[0].uuid.startswith("GPU-")
    assert not snap.gpus[0].mig_enabled
    # NVSwitch links count for the pair (nvidia-smi: NV18); PCIe path stays HOSTBRIDGE.
    assert snap.links == (Link(0, 1, "hostbridge", 18, "ok", "ok"),)
    assert (nv.init_calls, nv.shutdown_calls) == (1, 1)


def test_p2p_read_index_works_as_tuple_or_int() -> None:
    nv = rtx5090x2()
    assert nv.NVML_P2P_CAPS_INDEX_READ == (0,)
    assert read_nvml(nv).links[0].p2p_read == "chipset_not_supported"
    nv.NVML_P2P_CAPS_INDEX_READ = 0
    assert read_nvml(nv).links[0].p2p_read == "chipset_not_supported"


def test_rtx5090_pcie_has_no_nvlink_and_no_p2p() -> None:
    snap = read_nvml(rtx5090x2())
    assert snap.cuda_driver_version == "12.9"
    assert snap.links == (
        Link(0, 1, "hostbridge", 0, "chipset_not_supported", "chipset_not_supported"),
    )


def test_direct_nvlink_bridges_count_only_their_peer() -> None:
    snap = read_nvml(a6000x4())
    by_pair = {(ln.a, ln.b): ln for ln in snap.links}
    assert len(by_pair) == 6
    assert by_pair[0, 1].nvlinks == 4 and by_pair[2, 3].nvlinks == 4
    assert by_pair[0, 2].nvlinks == by_pair[1, 3].nvlinks == by_pair[0, 3].nvlinks == 0
    assert by_pair[0, 2].topology == "node"


def test_inactive_or_unreadable_links_are_not_counted() -> None:
    nv = a6000x4()
    nv.gpus[0].links[0].active = False  # type: ignore[index]
    nv.gpus[0].links[1].remote_bus = "00000000:99:00.0"  # type: ignore[index]
    assert read_nvml(nv).links[0].nvlinks == 2


def test_no_driver_is_an_actionable_error_not_an_exception() -> None:
    nv = no_driver()
    snap = read_nvml(nv)
    assert snap.gpus == () and snap.links == ()
    assert snap.error is not None
    assert "libnvidia-ml.so" in snap.error and "no NVIDIA driver" in snap.error
    assert nv.shutdown_calls == 0


def test_real_pynvml_on_this_machine_without_a_driver() -> None:
    pytest.importorskip("pynvml")
    snap = read_nvml()
    if snap.gpus:
        pytest.skip("this machine has GPUs")
    assert snap.error is not None and "driver" in snap.error


def test_missing_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    snap = read_nvml(present=lambda: True)  # a machine with an NVIDIA device: the advice stands
    assert snap.error is not None and "pip install nvidia-ml-py" in snap.error


def test_no_nvml_advice_on_a_machine_without_an_nvidia_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert read_nvml(present=lambda: False).error == NO_NVIDIA_DEVICE
    assert read_nvml(no_driver(), present=lambda: False).error == NO_NVIDIA_DEVICE
    assert read_nvml(no_driver(), present=lambda: True).error != NO_NVIDIA_DEVICE


def test_nvidia_present_reads_device_nodes_and_the_driver(tmp_path: Path) -> None:
    dev, proc = tmp_path / "dev", tmp_path / "proc"
    dev.mkdir()
    assert not nvidia_present(str(dev), str(proc))
    (dev / "nvidia0").touch()
    assert nvidia_present(str(dev), str(proc))


def test_unknown_init_error_is_described() -> None:
    nv = no_driver()
    nv.init_error = NVMLError(999)
    assert read_nvml(nv).error == "NVML could not start: NVMLError: NVML error 999"


def test_one_lost_gpu_degrades_to_unknown() -> None:
    nv = h200x2()
    nv.gpus[1].fail = {"nvmlDeviceGetName", "nvmlDeviceGetCudaComputeCapability"}
    snap = read_nvml(nv)
    assert snap.error is None
    assert snap.gpus[0].name == "NVIDIA H200"
    assert (snap.gpus[1].name, snap.gpus[1].compute_capability) == ("unknown", (0, 0))
    assert snap.gpus[1].pci_bus_id == "00000000:00:07.0"
    assert "GPU 1 name: unknown (NVMLError: GPU is lost)" in snap.notes
    assert nv.shutdown_calls == 1


def test_unopenable_gpu_keeps_its_slot() -> None:
    nv = h200x2()
    nv.gpus[0].fail = {"nvmlDeviceGetHandleByIndex"}
    snap = read_nvml(nv)
    assert [g.index for g in snap.gpus] == [0, 1]
    assert snap.gpus[0].name == "unknown" and snap.links == (Link(0, 1),)


def test_device_count_failure_is_the_snapshot_error() -> None:
    nv = failing(h200x2, {"nvmlDeviceGetCount"}, NVMLError(GPU_IS_LOST))
    snap = read_nvml(nv)
    assert snap.error == "NVML failed while listing GPUs: NVMLError: GPU is lost"
    assert nv.shutdown_calls == 1


def test_zero_gpus_says_so() -> None:
    nv = h200x2()
    nv.gpus = []
    assert read_nvml(nv).error == "the NVIDIA driver is loaded but lists no GPU"


def test_mig_instances_are_listed() -> None:
    snap = read_nvml(a100_mig())
    parent, plain = snap.gpus
    assert parent.mig_enabled and not plain.mig_enabled
    assert [(m.uuid[:12], m.gpu_instance, m.compute_instance) for m in parent.mig] == [
        ("MIG-11111111", 1, 0),
        ("MIG-22222222", 2, 0),
    ]
    assert parent.mig[0].name.endswith("MIG 3g.20gb")
    assert parent.mig[0].memory_bytes == 20937965568


_CALLS = [
    "nvmlSystemGetDriverVersion", "nvmlSystemGetCudaDriverVersion", "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetCudaComputeCapability",
    "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetPciInfo", "nvmlDeviceGetMigMode",
    "nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkRemoteDeviceType",
    "nvmlDeviceGetNvLinkRemotePciInfo", "nvmlDeviceGetTopologyCommonAncestor",
    "nvmlDeviceGetP2PStatus", "nvmlDeviceGetMaxMigDeviceCount", "nvmlShutdown",
]


@settings(max_examples=60, deadline=None)
@given(
    names=st.sets(st.sampled_from(_CALLS)),
    exc=st.sampled_from([NVMLError(3), RuntimeError("boom"), OSError(5, "io"), KeyError("x")]),
    machine=st.sampled_from([h200x2, rtx5090x2, a6000x4, a100_mig]),
)
def test_any_failing_call_never_raises(names: set[str], exc: Exception, machine: object) -> None:
    nv = failing(machine, names, exc)  # type: ignore[arg-type]
    snap = read_nvml(nv)
    assert snap.error is None
    assert len(snap.gpus) == len(nv.gpus)
    assert all(ln.topology in ("hostbridge", "node", "unknown") for ln in snap.links)


def test_a_wedged_driver_costs_the_deadline_not_the_decision() -> None:
    """NVML that never answers (a crashed driver blocks every call): the reading returns a
    `stalled` snapshot at its deadline; later readings answer at once while the driver is still
    stuck, and read again once it answers."""
    import threading

    from resilient_strategy.machine import nvml as nvml_mod

    release = threading.Event()
    fake = h200x2()
    calls: list[str] = []
    real_init = fake.nvmlInit

    def wedged_init() -> None:
        calls.append("init")
        release.wait(30)
        real_init()

    fake.nvmlInit = wedged_init
    try:
        snap = read_nvml(fake, deadline_s=0.2)
        assert snap.stalled and snap.gpus == () and snap.error
        again = read_nvml(h200x2(), deadline_s=5)  # not asked while the first still waits
        assert again.stalled and calls == ["init"]
    finally:
        release.set()
        for t in nvml_mod._STUCK:
            t.join(5)
    after = read_nvml(h200x2(), deadline_s=5)
    assert not after.stalled and len(after.gpus) == 2


def test_detect_facts_goes_on_without_gpu_facts_when_nvml_stalls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient_strategy.machine import inspect as inspect_mod
    from resilient_strategy.machine.nvml import NvmlSnapshot, stalled_error

    monkeypatch.setattr(inspect_mod, "read_nvml",
                        lambda nvml=None: NvmlSnapshot(error=stalled_error(20), stalled=True))
    facts = inspect_mod.detect_facts({"CUDA_VISIBLE_DEVICES": "0,1"})
    assert facts.gpus == () and facts.nvml_error == stalled_error(20)
