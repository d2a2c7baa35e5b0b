"""A fake pynvml module for tests: the functions _nvml.read_nvml calls, over described GPUs.

``h200x2()`` mirrors shared/recordings/h200x2-facts.json (NV18 through NVSwitch, topology 30,
``NVML_P2P_CAPS_INDEX_READ`` the tuple ``(0,)`` as in nvidia-ml-py 13.615, which the real binding
rejects with ctypes.ArgumentError).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NOT_SUPPORTED, INVALID_ARGUMENT, NOT_FOUND, LIBRARY_NOT_FOUND, GPU_IS_LOST = 3, 2, 6, 12, 15
SWITCH, GPU = 2, 0


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {3: "Not Supported", 6: "Not Found", 12: "NVML Shared Library Not Found",
                15: "GPU is lost"}.get(self.value, f"NVML error {self.value}")


@dataclass
class FakeLink:
    active: bool = True
    remote_type: int | None = SWITCH  # None: the query raises NOT_SUPPORTED
    remote_bus: str = "00000000:00:0F.0"


@dataclass
class FakeMig:
    uuid: str
    name: str
    mem: int
    gi: int
    ci: int


@dataclass
class FakeGpu:
    name: str
    uuid: str
    pci: str
    cc: tuple[int, int]
    mem: int
    links: list[FakeLink] | None = None  # None: NVLink not supported
    mig: list[FakeMig] | None = None  # None: MIG not supported; []: supported, disabled
    fail: set[str] = field(default_factory=set)  # NVML function names that raise for this GPU


class FakeNvml:
    """Module-like object. ``topo[(a, b)]`` and ``p2p[(a, b, caps_index)]`` describe pairs."""

    NVML_NVLINK_MAX_LINKS = 36
    NVML_P2P_CAPS_INDEX_READ: Any = (0,)
    NVML_P2P_CAPS_INDEX_NVLINK = 2

    def __init__(
        self,
        gpus: list[FakeGpu],
        topo: int = 30,
        p2p: dict[tuple[int, int, int], int] | None = None,
        *,
        driver: str = "580.159.04",
        cuda: int = 13000,
        init_error: BaseException | None = None,
        fail: dict[str, BaseException] | None = None,
    ) -> None:
        self.gpus = gpus
        self.topo = topo
        self.p2p = p2p or {}
        self.driver, self.cuda = driver, cuda
        self.init_error = init_error
        self.fail = fail or {}  # function name -> exception, for every call
        self.init_calls = self.shutdown_calls = 0

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml"):
            fail = object.__getattribute__(self, "fail")
            if name in fail:
                exc = fail[name]

                def raiser(*_: Any) -> Any:
                    raise exc

                return raiser
        return object.__getattribute__(self, name)

    # ----- lifecycle -------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda

    # ----- devices (handles: ("gpu", i) or ("mig", i, k)) ----------------------------------
    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> tuple[Any, ...]:
        self._check(("gpu", i), "nvmlDeviceGetHandleByIndex")
        return ("gpu", i)

    def _gpu(self, h: tuple[Any, ...]) -> FakeGpu:
        gpu: FakeGpu = self.gpus[h[1]]
        return gpu

    def _check(self, h: tuple[Any, ...], fn: str) -> None:
        if fn in self.gpus[h[1]].fail:
            raise NVMLError(GPU_IS_LOST)

    def _mig(self, h: tuple[Any, ...]) -> FakeMig | None:
        mig = self._gpu(h).mig
        return mig[h[2]] if h[0] == "mig" and mig else None

    def nvmlDeviceGetName(self, h: tuple[Any, ...]) -> str:
        self._check(h, "nvmlDeviceGetName")
        m = self._mig(h)
        return m.name if m else self._gpu(h).name

    def nvmlDeviceGetUUID(self, h: tuple[Any, ...]) -> str:
        m = self._mig(h)
        return m.uuid if m else self._gpu(h).uuid

    def nvmlDeviceGetCudaComputeCapability(self, h: tuple[Any, ...]) -> tuple[int, int]:
        self._check(h, "nvmlDeviceGetCudaComputeCapability")
        return self._gpu(h).cc

    def nvmlDeviceGetMemoryInfo(self, h: tuple[Any, ...]) -> SimpleNamespace:
        m = self._mig(h)
        return SimpleNamespace(total=m.mem if m else self._gpu(h).mem, free=0, used=0)

    def nvmlDeviceGetPciInfo(self, h: tuple[Any, ...]) -> SimpleNamespace:
        return SimpleNamespace(busId=self._gpu(h).pci.encode(), busIdLegacy=b"")

    def nvmlDeviceGetMigMode(self, h: tuple[Any, ...]) -> list[int]:
        mig = self._gpu(h).mig
        if mig is None:
            raise NVMLError(NOT_SUPPORTED)
        return [int(bool(mig)), int(bool(mig))]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: tuple[Any, ...]) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: tuple[Any, ...], k: int) -> tuple[Any, ...]:
        if k >= len(self._gpu(h).mig or ()):
            raise NVMLError(NOT_FOUND)
        return ("mig", h[1], k)

    def nvmlDeviceGetGpuInstanceId(self, h: tuple[Any, ...]) -> int:
        m = self._mig(h)
        assert m is not None
        return m.gi

    def nvmlDeviceGetComputeInstanceId(self, h: tuple[Any, ...]) -> int:
        m = self._mig(h)
        assert m is not None
        return m.ci

    # ----- links -------------------------------------------------------------------------------
    def _link(self, h: tuple[Any, ...], link: int) -> FakeLink:
        links = self._gpu(h).links
        if links is None:
            raise NVMLError(NOT_SUPPORTED)
        if link >= len(links):
            raise NVMLError(INVALID_ARGUMENT)
        return links[link]

    def nvmlDeviceGetNvLinkState(self, h: tuple[Any, ...], link: int) -> int:
        return int(self._link(h, link).active)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: tuple[Any, ...], link: int) -> int:
        kind = self._link(h, link).remote_type
        if kind is None:
            raise NVMLError(NOT_SUPPORTED)
        return kind

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: tuple[Any, ...], link: int) -> SimpleNamespace:
        return SimpleNamespace(busId=self._link(h, link).remote_bus.encode())

    def nvmlDeviceGetTopologyCommonAncestor(self, a: tuple[Any, ...], b: tuple[Any, ...]) -> int:
        return self.topo

    def nvmlDeviceGetP2PStatus(self, a: tuple[Any, ...], b: tuple[Any, ...], index: Any) -> int:
        if not isinstance(index, int):  # what the ctypes binding does with the (0,) constant
            raise ctypes.ArgumentError("argument 3: TypeError: wrong type")
        return self.p2p.get((min(a[1], b[1]), max(a[1], b[1]), index), 0)


# ----- machines ------------------------------------------------------------------------------
def h200x2() -> FakeNvml:
    """2x H200, 18 active NVLinks each landing on NVSwitches, topology HOSTBRIDGE (30)."""
    gpus = [
        FakeGpu("NVIDIA H200", f"GPU-5d2c7a1e-0000-4000-8000-00000000000{i}",
                f"00000000:00:0{6 + i}.0", (9, 0), 150754820096,
                links=[FakeLink(remote_bus=f"00000000:00:1{k % 4}.0") for k in range(18)])
        for i in range(2)
    ]
    return FakeNvml(gpus, topo=30)


def rtx5090x2() -> FakeNvml:
    """2x RTX 5090 on PCIe: no NVLink, P2P not supported by the chipset."""
    gpus = [
        FakeGpu("NVIDIA GeForce RTX 5090", f"GPU-9a0b1c2d-1111-4000-8000-00000000000{i}",
                f"00000000:0{1 + i}:00.0", (12, 0), 34190917632)
        for i in range(2)
    ]
    return FakeNvml(gpus, topo=30, p2p={(0, 1, 0): 1, (0, 1, 2): 1}, driver="575.51.03",
                    cuda=12090)


def a6000x4() -> FakeNvml:
    """4x RTX A6000 with NVLink bridges 0-1 and 2-3 (4 direct links each), PCIe otherwise."""
    bus = [f"00000000:{b:02X}:00.0" for b in (0x1A, 0x1B, 0x3D, 0x3E)]
    peer = {0: 1, 1: 0, 2: 3, 3: 2}
    gpus = [
        FakeGpu("NVIDIA RTX A6000", f"GPU-a6000000-2222-4000-8000-00000000000{i}", bus[i],
                (8, 6), 51527024640,
                links=[FakeLink(remote_type=GPU, remote_bus=bus[peer[i]]) for _ in range(4)])
        for i in range(4)
    ]
    return FakeNvml(gpus, topo=40)


def a100_mig() -> FakeNvml:
    """1x A100 40GB with MIG enabled (two 3g.20gb instances) and 1x A100 without MIG."""
    mig = [
        FakeMig("MIG-11111111-aaaa-5000-8000-000000000001", "NVIDIA A100-SXM4-40GB MIG 3g.20gb",
                20937965568, 1, 0),
        FakeMig("MIG-22222222-bbbb-5000-8000-000000000002", "NVIDIA A100-SXM4-40GB MIG 3g.20gb",
                20937965568, 2, 0),
    ]
    gpus = [
        FakeGpu("NVIDIA A100-SXM4-40GB", "GPU-a1000000-3333-4000-8000-000000000000",
                "00000000:07:00.0", (8, 0), 42505273344, mig=mig),
        FakeGpu("NVIDIA A100-SXM4-40GB", "GPU-a1000000-3333-4000-8000-000000000001",
                "00000000:0F:00.0", (8, 0), 42505273344, mig=[]),
    ]
    return FakeNvml(gpus, topo=40)


def no_driver() -> FakeNvml:
    return FakeNvml([], init_error=NVMLError(LIBRARY_NOT_FOUND))


def failing(machine: Callable[[], FakeNvml], names: set[str], exc: BaseException) -> FakeNvml:
    """``machine()`` where every call of the named NVML functions raises ``exc``."""
    nv = machine()
    nv.fail = dict.fromkeys(names, exc)
    return nv
