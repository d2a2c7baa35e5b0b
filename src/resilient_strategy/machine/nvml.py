"""The only module that talks to NVML (pynvml, imported inside `read_nvml`).

Never raises: a missing driver, a missing pynvml or any NVML error becomes ``NvmlSnapshot.error``;
a failing call for one GPU or pair degrades that value to "unknown" and adds a note.
NVML API: https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html

Never hangs either: the reading runs in a daemon thread under `NVML_DEADLINE_S`. A crashed
driver makes every NVML call (and nvidia-smi) block for good (public reports: "in case NVIDIA
crashes completely, nvidia-smi will hang", https://github.com/ocf/puppet/pull/615; a GPU
"fallen off the bus", Xid 79, https://github.com/NVIDIA/open-gpu-kernel-modules/issues/507);
past the deadline the snapshot says so (``stalled``, with the fix in ``error``) and the decision
goes on without GPU facts. The stuck thread is abandoned (ctypes releases the GIL while it waits
in the driver), and later readings in this process answer at once: a driver that did not answer
once is not asked again.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..core.values.facts import P2P_STATUSES, Link
from ..process import PROCESS
from .visible import MigDevice, PhysicalGpu

#: nvmlGpuTopologyLevel_t values -> facts.TOPOLOGY_LEVELS words.
_TOPOLOGY = {
    0: "internal", 10: "single", 20: "multiple", 30: "hostbridge", 40: "node", 50: "system"
}
_NVLINK_SWITCH = 2  # NVML_NVLINK_DEVICE_TYPE_SWITCH
_NVLINK_GPU = 0  # NVML_NVLINK_DEVICE_TYPE_GPU
_INIT_ERRORS = {
    12: "NVIDIA driver library not found (libnvidia-ml.so.1): no NVIDIA driver on this machine, "
    "or it is not mounted into this container (docker run --gpus all)",
    9: "the NVIDIA driver is installed but not loaded (NVML: Driver Not Loaded); check "
    "`nvidia-smi` and `dmesg`",
    4: "no permission to open the NVIDIA devices (/dev/nvidia*); check the user's groups or the "
    "container's device mounts",
    18: "the NVIDIA kernel driver and its user-space library differ in version (NVML: RM version "
    "mismatch); reboot after the driver update",
}


@dataclass(frozen=True)
class NvmlSnapshot:
    """What NVML said. ``links`` use NVML indices (a < b); ``error``: why nothing was read."""

    gpus: tuple[PhysicalGpu, ...] = ()
    links: tuple[Link, ...] = ()
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # "13.0"
    error: str | None = None
    notes: tuple[str, ...] = ()  # per-GPU values that could not be read
    #: NVML did not answer within the deadline (a wedged driver): GPUs unknown, not absent.
    stalled: bool = False


#: How long NVML may take to list the GPUs and their links. Generous: without the persistence
#: daemon each GPU is initialised when its handle is first taken (NVML's
#: nvmlDeviceGetHandleBy*: https://docs.nvidia.com/deploy/nvml-api/group__nvmlInitializationAndCleanup.html),
#: seconds on an 8-GPU node.
NVML_DEADLINE_S = 20.0

#: Readings of this process still waiting in the driver (their thread is abandoned).
#: Process-wide by nature: the driver call blocks the process's NVML, not one caller's.
_STUCK: list[threading.Thread] = PROCESS.hold(
    "machine.nvml.stuck", list, "the NVML reading threads the driver never returned from")


def stalled_error(deadline_s: float) -> str:
    """The line a stalled reading leaves in the facts (``Facts.nvml_error``)."""
    return (f"NVML did not answer within {deadline_s:g} s (a wedged NVIDIA driver blocks every "
            "NVML and CUDA call; see `nvidia-smi` and `dmesg` for an Xid, then reset the GPU or "
            "reboot); deciding without GPU facts")


#: Why there are no GPU facts on a machine with no NVIDIA device at all: said without advice
#: (installing NVML or mounting a driver helps nothing there).
NO_NVIDIA_DEVICE = "no NVIDIA GPU on this machine (no /dev/nvidia* device, no NVIDIA driver)"


def nvidia_present(dev: str = "/dev", proc: str = "/proc/driver/nvidia") -> bool:
    """Whether this machine has an NVIDIA device node or a loaded NVIDIA driver (files only)."""
    from pathlib import Path

    try:
        return Path(proc).exists() or any(Path(dev).glob("nvidia[0-9]*"))
    except OSError:
        return True  # unreadable: assume there may be one (the advice then stays)


def read_nvml(nvml: Any = None, *, present: Callable[[], bool] | None = None,
              deadline_s: float = NVML_DEADLINE_S) -> NvmlSnapshot:
    """Read GPUs, pairs and driver versions. ``nvml``: a pynvml-like module (default: pynvml).

    ``present``: whether the machine has an NVIDIA device (default `nvidia_present` when
    ``nvml`` is pynvml itself, not asked for a given module). Where it has none, a missing
    pynvml or driver library is said as `NO_NVIDIA_DEVICE`, with no advice to install.
    ``deadline_s``: how long the reading may take; past it a ``stalled`` snapshot."""
    if any(t.is_alive() for t in _STUCK):
        return NvmlSnapshot(error=stalled_error(deadline_s), stalled=True)
    box: list[NvmlSnapshot] = []

    def read() -> None:
        try:
            box.append(_read(nvml, present))
        except BaseException as exc:  # never raises (see above)
            box.append(NvmlSnapshot(error=f"NVML failed: {_why(exc)}"))

    reader = threading.Thread(target=read, name="rs-nvml", daemon=True)
    reader.start()
    reader.join(deadline_s)
    if reader.is_alive():
        _STUCK.append(reader)
        return NvmlSnapshot(error=stalled_error(deadline_s), stalled=True)
    return box[0]


def _read(nvml: Any, present: Callable[[], bool] | None) -> NvmlSnapshot:
    if present is None and nvml is None:
        present = nvidia_present
    if nvml is None:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError:
            if present is not None and not present():
                return NvmlSnapshot(error=NO_NVIDIA_DEVICE)
            return NvmlSnapshot(
                error="nvidia-ml-py is not installed, so GPUs cannot be inspected; "
                "pip install nvidia-ml-py"
            )
    try:
        nvml.nvmlInit()
    except Exception as exc:
        code = getattr(exc, "value", None)
        if code in (9, 12) and present is not None and not present():
            return NvmlSnapshot(error=NO_NVIDIA_DEVICE)
        known = _INIT_ERRORS.get(code) if isinstance(code, int) else None
        return NvmlSnapshot(error=known or f"NVML could not start: {_why(exc)}")
    try:
        return _Reader(nvml).snapshot()
    except Exception as exc:
        return NvmlSnapshot(error=f"NVML failed while listing GPUs: {_why(exc)}")
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


class _Reader:
    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.notes: list[str] = []

    def get(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or ``None`` with a note when it fails."""
        try:
            return fn(*args)
        except Exception as exc:
            self.notes.append(f"{what}: unknown ({_why(exc)})")
            return None

    def snapshot(self) -> NvmlSnapshot:
        nv = self.nvml
        driver = self.get("driver version", nv.nvmlSystemGetDriverVersion)
        cuda = self.get("CUDA driver version", nv.nvmlSystemGetCudaDriverVersion)
        count = int(nv.nvmlDeviceGetCount())
        handles = [self.get(f"GPU {i}", nv.nvmlDeviceGetHandleByIndex, i) for i in range(count)]
        gpus = tuple(self.gpu(i, h) for i, h in enumerate(handles))
        bus_to_index = {g.pci_bus_id: g.index for g in gpus if g.pci_bus_id}
        nvl = [self.nvlinks(h, bus_to_index) for h in handles]
        # NVLinks whose far end is a GPU this process cannot see (a pod or container given some
        # of a host's GPUs): to a GPU NVML does not list, or, with one GPU listed, to NVSwitches
        gpus = tuple(replace(g, nvlinks_outside=outside + (switch if count == 1 else 0))
                     if outside or (switch and count == 1) else g
                     for g, (_, switch, outside) in zip(gpus, nvl, strict=True))
        links = tuple(
            self.link(a, b, handles[a], handles[b], nvl[a][0][b], nvl[a][1], nvl[b][1])
            for a in range(count)
            for b in range(a + 1, count)
        )
        return NvmlSnapshot(
            gpus=gpus,
            links=links,
            driver_version=None if driver is None else _text(driver),
            cuda_driver_version=None if cuda is None else f"{cuda // 1000}.{cuda % 1000 // 10}",
            error=None if count else "the NVIDIA driver is loaded but lists no GPU",
            notes=tuple(self.notes),
        )

    def gpu(self, i: int, h: Any) -> PhysicalGpu:
        if h is None:
            return PhysicalGpu(index=i)
        nv, at = self.nvml, f"GPU {i}"
        cc = self.get(f"{at} compute capability", nv.nvmlDeviceGetCudaComputeCapability, h)
        mem = self.get(f"{at} memory", nv.nvmlDeviceGetMemoryInfo, h)
        pci = self.get(f"{at} PCI bus id", nv.nvmlDeviceGetPciInfo, h)
        try:  # NOT_SUPPORTED on GPUs without MIG: not worth a note
            mig_enabled = int(nv.nvmlDeviceGetMigMode(h)[0]) == 1
        except Exception:
            mig_enabled = False
        return PhysicalGpu(
            index=i,
            uuid=_text(self.get(f"{at} UUID", nv.nvmlDeviceGetUUID, h) or ""),
            name=_text(self.get(f"{at} name", nv.nvmlDeviceGetName, h) or "unknown"),
            compute_capability=(0, 0) if cc is None else (int(cc[0]), int(cc[1])),
            memory_bytes=0 if mem is None else int(mem.total),
            pci_bus_id="" if pci is None else _bus_id(pci),
            mig_enabled=mig_enabled,
            mig=self.mig_devices(h) if mig_enabled else (),
            memory_free_bytes=None if mem is None else int(mem.free),
        )

    def mig_devices(self, h: Any) -> tuple[MigDevice, ...]:
        nv, out = self.nvml, []
        slots = self.get("MIG device count", nv.nvmlDeviceGetMaxMigDeviceCount, h)
        for k in range(int(slots or 0)):
            try:  # empty slots raise NOT_FOUND
                m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
                uuid = _text(nv.nvmlDeviceGetUUID(m))
            except Exception:
                continue
            mem = self.get(f"{uuid} memory", nv.nvmlDeviceGetMemoryInfo, m)
            gi = self.get(f"{uuid} GPU instance id", nv.nvmlDeviceGetGpuInstanceId, m)
            ci = self.get(f"{uuid} compute instance id", nv.nvmlDeviceGetComputeInstanceId, m)
            out.append(
                MigDevice(
                    uuid=uuid,
                    name=_text(self.get(f"{uuid} name", nv.nvmlDeviceGetName, m) or ""),
                    memory_bytes=0 if mem is None else int(mem.total),
                    gpu_instance=-1 if gi is None else int(gi),
                    compute_instance=-1 if ci is None else int(ci),
                )
            )
        return tuple(out)

    def nvlinks(self, h: Any, bus_to_index: dict[str, int]) -> tuple[Counter[int], int, int]:
        """Active NVLinks of one GPU: per peer GPU index, how many land on an NVSwitch, and how
        many land on a GPU that NVML does not list here (outside this container).

        Links on an NVSwitch (HGX boards: every GPU's links go to the switches) connect the GPU
        to every other switch-attached GPU, which nvidia-smi shows as NV<links> for each pair.
        A link whose state or far end cannot be read is not counted.
        """
        nv, direct, switch, outside = self.nvml, Counter[int](), 0, 0
        if h is None:
            return direct, 0, 0
        for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                if int(nv.nvmlDeviceGetNvLinkState(h, link)) != 1:
                    continue
            except Exception:
                continue
            try:
                kind = int(nv.nvmlDeviceGetNvLinkRemoteDeviceType(h, link))
            except Exception:
                kind = None
            if kind == _NVLINK_SWITCH:
                switch += 1
                continue
            try:
                peer = bus_to_index.get(_bus_id(nv.nvmlDeviceGetNvLinkRemotePciInfo(h, link)))
            except Exception:
                continue
            if peer is not None:
                direct[peer] += 1
            elif kind == _NVLINK_GPU:
                outside += 1
        return direct, switch, outside

    def link(
        self, a: int, b: int, ha: Any, hb: Any, direct: int, switch_a: int, switch_b: int
    ) -> Link:
        if ha is None or hb is None:
            return Link(a=a, b=b)
        nv, at = self.nvml, f"GPUs {a}-{b}"
        level = self.get(f"{at} topology", nv.nvmlDeviceGetTopologyCommonAncestor, ha, hb)
        read = getattr(nv, "NVML_P2P_CAPS_INDEX_READ", 0)
        # nvidia-ml-py 13.615 defines NVML_P2P_CAPS_INDEX_READ as the tuple (0,): pass the int.
        read = int(read[0] if isinstance(read, tuple) else read)
        nvlink = int(getattr(nv, "NVML_P2P_CAPS_INDEX_NVLINK", 2))
        return Link(
            a=a,
            b=b,
            topology=_TOPOLOGY.get(-1 if level is None else int(level), "unknown"),
            nvlinks=direct + (min(switch_a, switch_b) if switch_a and switch_b else 0),
            p2p_read=self.p2p(f"{at} P2P read", ha, hb, read),
            p2p_nvlink=self.p2p(f"{at} P2P NVLink", ha, hb, nvlink),
        )

    def p2p(self, what: str, ha: Any, hb: Any, index: int) -> str:
        status = self.get(what, self.nvml.nvmlDeviceGetP2PStatus, ha, hb, index)
        if status is None or not 0 <= int(status) < len(P2P_STATUSES):
            return "unknown"
        return P2P_STATUSES[int(status)]


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _bus_id(pci: Any) -> str:
    """The PCI bus id of an nvmlPciInfo_t, normalized ("00000000:00:06.0")."""
    return _text(getattr(pci, "busId", b"") or getattr(pci, "busIdLegacy", b"")).strip().upper()


def _why(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        text = ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
