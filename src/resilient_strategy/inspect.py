"""``detect_facts()``: one frozen snapshot of GPUs, links, host and frameworks.

Imports no framework and never raises for hardware problems: without a driver the facts hold zero
GPUs and ``nvml_error`` says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from . import _env
from ._nvml import NvmlSnapshot, read_nvml
from .facts import Facts, Gpu, Visibility, relevant_env
from .guard import first_import_site
from .host import detect_host
from .versions import detect_frameworks
from .visible import VisibleDevice, renumber_links, resolve_visible_devices


def detect_facts(
    env: Mapping[str, str] | None = None,
    *,
    nvml: object | None = None,
    root: str = "/",
    modules: Mapping[str, object] | None = None,
) -> Facts:
    """Inspect this machine as the job will see it.

    Args:
        env: the environment to decide on (default ``os.environ``).
        nvml: a pynvml-like module to read GPUs from (default: pynvml).
        root: the file-system root for host facts (tests point it at a fake tree).
        modules: the imported modules (default ``sys.modules``).
    """
    environ = _env.snapshot(env)
    snap = read_nvml(nvml)
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    devices: tuple[VisibleDevice, ...] = ()
    if snap.error is not None:
        visibility, devices = Visibility(raw=raw), ()
    else:
        res = resolve_visible_devices(
            raw, snap.gpus, device_order=environ.get("CUDA_DEVICE_ORDER")
        )
        visibility, devices = res.visibility, res.devices
    frameworks = tuple(
        replace(f, imported_at=first_import_site(f.name)) if f.imported else f
        for f in detect_frameworks(modules)
    )
    return Facts(
        gpus=tuple(_gpu(i, d, snap) for i, d in enumerate(devices)),
        links=renumber_links(devices, snap.links),
        driver_version=snap.driver_version,
        cuda_driver_version=snap.cuda_driver_version,
        nvml_error=snap.error,
        visibility=visibility,
        host=detect_host(environ, root),
        frameworks=frameworks,
        env=relevant_env(environ),
        nvml_notes=snap.notes,
    )


def _gpu(ordinal: int, dev: VisibleDevice, snap: NvmlSnapshot) -> Gpu:
    parent = next(g for g in snap.gpus if g.index == dev.physical)
    mig = dev.mig
    return Gpu(
        index=ordinal,
        name=(mig.name or f"{parent.name} (MIG)") if mig else parent.name,
        compute_capability=parent.compute_capability,
        memory_bytes=mig.memory_bytes if mig else parent.memory_bytes,
        uuid=mig.uuid if mig else parent.uuid,
        pci_bus_id=parent.pci_bus_id,
        physical_index=parent.index,
        mig_enabled=mig is not None or parent.mig_enabled,
    )
