"""``detect_facts()``: one frozen snapshot of GPUs, links, host and frameworks.

Imports no framework and never raises for hardware problems: without a driver the facts hold zero
GPUs and ``nvml_error`` says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ..core.values.facts import Facts, Visibility, compact_links, relevant_env
from . import env as machine_env
from .guard import ImportWatch, first_import_site
from .host import detect_host, gpu_numa_node
from .nvml import read_nvml
from .platform import detect_platform
from .versions import MetadataSource, detect_frameworks
from .visible import VisibleDevice, job_gpu, renumber_links, resolve_visible_devices


def detect_facts(
    env: Mapping[str, str] | None = None,
    *,
    nvml: object | None = None,
    root: str = "/",
    modules: Mapping[str, object] | None = None,
    imports: ImportWatch | None = None,
    packages: MetadataSource | None = None,
) -> Facts:
    """Inspect this machine as the job will see it.

    Args:
        env: the environment to decide on (default ``os.environ``).
        nvml: a pynvml-like module to read GPUs from (default: pynvml).
        root: the file-system root for host facts (tests point it at a fake tree).
        modules: the imported modules (default ``sys.modules``).
        imports: the import watch that knows where each framework was first imported (default
            the package's).
        packages: where installed packages are read from (default this interpreter's).
    """
    environ = machine_env.snapshot(env)
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
        replace(f, imported_at=first_import_site(f.name, imports)) if f.imported else f
        for f in detect_frameworks(modules, packages)
    )
    parents = {g.index: g for g in snap.gpus}
    gpus = tuple(job_gpu(i, d, parents[d.physical]) for i, d in enumerate(devices))
    gpus = tuple(replace(g, numa_node=gpu_numa_node(root, g.pci_bus_id)) if g.pci_bus_id else g
                 for g in gpus)
    links, fabric = compact_links(len(gpus), renumber_links(devices, snap.links))
    return Facts(
        gpus=gpus,
        links=links,
        fabric=fabric,
        driver_version=snap.driver_version,
        cuda_driver_version=snap.cuda_driver_version,
        nvml_error=snap.error,
        visibility=visibility,
        host=detect_host(environ, root),
        frameworks=frameworks,
        env=relevant_env(environ),
        nvml_notes=snap.notes,
        platform=detect_platform(environ, root),
    )
