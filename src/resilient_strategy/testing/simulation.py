"""Described machines and simulated probe outcomes: what-if planning without the hardware.

`DescribedMachine` is a described machine as one typed value (the ``"machine"`` object of a
machine case), ``machine()`` its keyword form: each builds the Facts that inspection would report;
``SimulatedProber`` answers probes from a table of outcomes; ``load_simulation`` reads the JSON
files of ``resilient-strategy --simulate`` and ``examples/machines``. The testing kit
(``resilient_strategy.testing``) builds on this module; production code never imports the kit.
Over 450 lines for a reason: a described machine, its file format and the prober that answers
for it are one description, checked together (a field or outcome typo is one clean error).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from ..core.measures.probe import CAUSES, ERROR, OK, TIMEOUT, ProbeResult, ProbeSpec, parse_probe
from ..core.values.candidate import NODE0_MARK, OFFLOAD_MARK, SHARDED_MARK
from ..core.values.facts import (
    FABRIC_MIN_GPUS,
    P2P_STATUSES,
    TOPOLOGY_LEVELS,
    Facts,
    FrameworkInfo,
    Gpu,
    Host,
    Link,
    Platform,
    Visibility,
    compact_links,
)
from ..core.values.outcome import WorkerOutcome
from ..errors import InvalidOptionError, ResilientStrategyError
from ..machine import files
from ..machine.visible import (
    MigDevice,
    PhysicalGpu,
    job_gpu,
    renumber_links,
    resolve_visible_devices,
)
from ..probing import cost, forkserver
from ..probing.base import Prober
from ..vocab import FRAMEWORKS

#: Kinds of hang a simulated probe can be judged to have (see `progress.Stall`).
HANG_KINDS = ("setup", "collective", "straggler", "quiet")


def gpu(
    index: int = 0,
    name: str = "NVIDIA H200",
    cc: tuple[int, int] = (9, 0),
    memory_gb: float = 141,
    *,
    mig: bool = False,
    free_gb: float | None = None,
    nvlinks_outside: int = 0,
    numa_node: int | None = None,
    uuid: str | None = None,
) -> Gpu:
    """One fake GPU. ``index`` is its NVML (physical) index, and its CUDA ordinal while no
    ``CUDA_VISIBLE_DEVICES`` renumbers it (see `machine`). ``free_gb``: its free memory
    as NVML would report it (None: unknown, so no memory check rules a candidate out on it).
    ``nvlinks_outside``: its active NVLinks to GPUs this container cannot see (a pod given one
    GPU of an NVLinked host). ``numa_node``: the host NUMA node it hangs off (None: unknown).
    ``uuid``: its UUID (default ``GPU-fake-<index>``); a task confined to one GPU by cgroups
    sees it as NVML index 0 whichever GPU it is, so ``gpu(0, uuid="GPU-fake-0001")`` is the
    second GPU of the host as that task sees it."""
    if numa_node is not None:
        _check_int("gpu", "numa_node", numa_node)
    _check_int("gpu", "index", index)
    _check_str("gpu", "name", name)
    free = None if free_gb is None else int(_number("gpu", "free_gb", free_gb) * 2**30)
    total = int(_number("gpu", "memory_gb", memory_gb) * 2**30)
    if free is not None and free > total:
        raise _bad("free_gb", free_gb, f"at most memory_gb ({memory_gb})", "gpu")
    return Gpu(
        index=index, name=name, compute_capability=_cc("gpu", cc),
        memory_bytes=int(_number("gpu", "memory_gb", memory_gb) * 2**30),
        uuid=f"GPU-fake-{index:04d}" if uuid is None else _check_str("gpu", "uuid", uuid),
        pci_bus_id=f"00000000:{index + 1:02x}:00.0",
        physical_index=index, mig_enabled=_check_bool("gpu", "mig", mig),
        memory_free_bytes=free, nvlinks_outside=_check_int("gpu", "nvlinks_outside",
                                                           nvlinks_outside),
        numa_node=numa_node,
    )


@dataclass(frozen=True)
class DescribedMachine:
    """A described machine as one typed value: its fields are exactly the keys of a machine
    case's ``"machine"`` object (``--simulate`` files, ``examples/machines``), with `machine`'s
    defaults. Every field is checked when the value is made: a wrong one is an
    ``InvalidOptionError`` naming it; `facts` is the Facts that
    `resilient_strategy.machine.inspect.detect_facts` would report for it.

    ``gpus`` are the physical GPUs (a count, or `gpu` values with distinct indices, or
    objects of `gpu` keyword arguments as a JSON file gives them), in NVML order;
    ``name`` / ``cc`` / ``memory_gb`` describe each GPU of a count. ``env["CUDA_VISIBLE_DEVICES"]``
    picks and renumbers them exactly as CUDA does
    (`resilient_strategy.machine.visible.resolve_visible_devices`), so
    ``machine(4, env={"CUDA_VISIBLE_DEVICES": "2"})`` has one GPU, ordinal 0, NVML index 2.
    ``nvlink`` is the number of NVLinks between each pair of GPUs (``p2p``, ``topology``: their
    P2P status and PCIe path); ``links`` overrides them per
    pair of physical indices: ``{(0, 1): 4, (2, 3): 4}``, or ``{"0-1": 4, "2-3": 4}`` (JSON); a
    pair's value may also be an object ``{"nvlinks": 0, "topology": "system", "p2p":
    "not_supported"}`` (every field optional) for its PCIe path and P2P status. ``mig`` gives MIG
    instances per physical GPU (``{0: 2}``: GPU 0 has two, ``MIG-fake-0000-0`` and ``-1``, which
    ``CUDA_VISIBLE_DEVICES`` can name). The host: ``shm_mb``, ``container``, ``wsl2``,
    ``sagemaker``, ``aws``, ``efa``, ``iommu``, ``infiniband``, ``kernel``, ``cpu_count``,
    ``platform``. The frameworks installed: ``torch`` (``torch_cuda``, ``torch_nccl``,
    ``torch_archs``), ``tensorflow`` (``tf_cuda``, ``tf_archs``, ``tf_nccl``), ``keras`` (None:
    not installed); ``imported`` / ``gpu_initialized`` name frameworks this
    process imported (and whose GPU runtime started). ``driver``: the NVIDIA driver version;
    ``nvml_error``: why NVML could not be read; ``nvml_notes`` are values NVML could not
    read. ``host_memory_gb``: the host memory available to new processes (None: unknown).
    ``driver_cuda``: the newest CUDA the driver supports (nvidia-smi's header; 535 drivers: 12.2).
    ``torch_hip``: the HIP version of a ROCm build of torch (give ``torch_cuda=None`` with it,
    and ``amd_gpus``, the AMD GPUs the ROCm driver lists; NVIDIA ``gpus`` stay 0 there).
    ``platform="darwin"`` with ``cpu_arch="arm64"`` is a Mac with Apple silicon (MPS).
    ``numa_nodes`` / ``numa_memory_only``: the host's NUMA nodes with memory, and of them those
    without a CPU; ``gpu_numa``: each physical GPU's NUMA node, in NVML order. ``cuda_compat``:
    the version of the CUDA forward-compatibility driver in the image ("" none);
    ``port_range``: the kernel's ephemeral port range ("32768-60999").
    ``platform_facts`` is the platform around the GPUs as one value (`Platform`, or
    its fields as a mapping: ``{"nvswitch": true, "rdma_link_layer": "ethernet",
    "rdma_devices": ["mlx5_0"], "master_ifname": "eth0", "hypervisor": "kvm",
    "hostname_loopback": true}``).
    ``nodes``: the other nodes of a multi-node job (node 1, 2, ...), each as what differs from
    this one (node 0): fields of `NodeFacts` (``{"nccl": "2.27.3"}``, ``{"net_plugins": []}``,
    ``{"boot_id": "..."}``), its ``env`` merged into this node's NCCL_* / GLOO_* variables (a
    null value: unset there). The facts then carry every node, as node 0 gathers them through
    the job's store, and the planner compares them before any probe.
    """

    gpus: int | Sequence[Gpu | Mapping[str, Any]] = 2
    name: str = "NVIDIA H200"
    cc: tuple[int, int] = (9, 0)
    memory_gb: float = 141
    nvlink: int = 0
    links: Mapping[tuple[int, int] | str, int | Mapping[str, Any]] | None = None
    p2p: str = "ok"
    topology: str = "hostbridge"
    shm_mb: int | None = 65536
    container: str = ""
    wsl2: bool = False
    sagemaker: bool = False
    aws: bool = False
    efa: bool = False
    iommu: str = "unknown"
    infiniband: bool = False
    kernel: str = "6.8.0"
    cpu_count: int = 32
    platform: str = "linux"
    mig: Mapping[int | str, int] | None = None
    torch: str | None = "2.11.0"
    torch_cuda: str | None = "13.0"
    torch_nccl: str | None = "2.28.9"
    torch_archs: Sequence[str] = ()
    tensorflow: str | None = None
    tf_cuda: str | None = None
    tf_archs: Sequence[str] = ()
    tf_nccl: str | None = None
    keras: str | None = None
    driver: str | None = "580.159.04"
    driver_cuda: str | None = "13.0"
    env: Mapping[str, str] | None = None
    nvml_error: str | None = None
    nvml_notes: Sequence[str] = ()
    imported: Sequence[str] = ()
    gpu_initialized: Sequence[str] = ()
    platform_facts: Platform | Mapping[str, Any] | None = None
    host_memory_gb: float | None = None
    nodes: Sequence[Mapping[str, Any]] | None = None
    torch_hip: str | None = None
    cpu_arch: str = ""
    numa_nodes: int | None = None
    numa_memory_only: int | None = None
    gpu_numa: Sequence[int] | None = None
    amd_gpus: int | None = None
    cuda_compat: str = ""
    port_range: str = ""
    #: the Facts of this description, built (and so every field checked) when it is made
    _facts: Facts = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_facts", _described_facts(self))

    @classmethod
    def from_mapping(cls, data: object) -> DescribedMachine:
        """The ``"machine"`` object of a JSON machine case: a ValueError names a key that is
        not a field, or a missing ``gpus``; a wrong value is the ``InvalidOptionError`` (a
        ValueError) naming it."""
        if not isinstance(data, Mapping):
            raise ValueError("machine: expected an object of machine() keyword arguments")
        if "gpus" not in data:
            raise ValueError('machine: say how many GPUs: "gpus": 2 (0 for none)')
        unknown = sorted(set(data) - set(MACHINE_KEYS))
        if unknown:
            raise ValueError(f"machine: unknown field(s) {unknown}; allowed: {list(MACHINE_KEYS)}")
        return cls(**data)

    def facts(self) -> Facts:
        """The Facts that inspection would report for this machine."""
        return self._facts


def machine(gpus: int | Sequence[Gpu | Mapping[str, Any]] = 2, **kw: Any) -> Facts:
    """Facts for a described machine, as `resilient_strategy.machine.inspect.detect_facts` would
    report them: the keyword arguments are the fields of `DescribedMachine` (what each means
    is said there). Every argument is checked: a wrong one is an ``InvalidOptionError`` naming
    it; an unknown one a ``TypeError``."""
    return DescribedMachine(gpus, **kw).facts()


def _described_facts(m: DescribedMachine) -> Facts:
    """The Facts of a described machine, its fields checked in the order they are listed."""
    a: dict[str, Any] = {f.name: getattr(m, f.name) for f in fields(m) if f.init}
    env_map = _string_map("env", m.env)
    plat = _platform_value(m.platform_facts)
    host_memory = None if m.host_memory_gb is None else int(
        _number("machine", "host_memory_gb", m.host_memory_gb) * 2**30)
    described: int | Sequence[Any] = m.gpus
    if isinstance(m.gpus, Sequence) and not isinstance(m.gpus, str):
        described = [gpu(**g) if isinstance(g, Mapping) else g for g in m.gpus]
    _check_arguments(a)
    physical = _physical_gpus(m.gpus, described, m.name, m.cc, m.memory_gb)
    gs, visible_links, fabric, visibility = _visible(a, physical, env_map)
    facts = Facts(
        gpus=gs,
        links=visible_links,
        fabric=fabric,
        driver_version=m.driver if physical else None,
        cuda_driver_version=m.driver_cuda if physical else None,
        nvml_error=m.nvml_error if m.nvml_error or physical else "no GPU in this description",
        visibility=visibility,
        host=_host(a, host_memory),
        frameworks=_frameworks(a),
        env=tuple(sorted(env_map.items())),
        nvml_notes=tuple(m.nvml_notes),
        platform=plat,
    )
    return _with_nodes(facts, m.nodes) if m.nodes else facts


#: The keys a machine case's ``"machine"`` object may hold: the fields of `DescribedMachine`.
MACHINE_KEYS = tuple(f.name for f in fields(DescribedMachine) if f.init)


def _check_arguments(a: Mapping[str, Any]) -> None:
    """`machine`'s scalar and list arguments checked, in the order they are listed."""
    _cc("machine", a["cc"])
    _number("machine", "memory_gb", a["memory_gb"])
    _check_int("machine", "nvlink", a["nvlink"])
    _check_choice("p2p", a["p2p"], P2P_STATUSES)
    _check_choice("topology", a["topology"], TOPOLOGY_LEVELS)
    _check_choice("iommu", a["iommu"], ("on", "off", "unknown"))
    if a["shm_mb"] is not None:
        _check_int("machine", "shm_mb", a["shm_mb"])
    _check_str("machine", "name", a["name"])
    _check_str("machine", "container", a["container"])
    for flag in ("wsl2", "sagemaker", "aws", "efa", "infiniband"):
        _check_bool("machine", flag, a[flag])
    for key in ("kernel", "platform", "cpu_arch", "cuda_compat", "port_range"):
        _check_str("machine", key, a[key])
    for key in ("numa_nodes", "numa_memory_only", "amd_gpus"):
        if a[key] is not None:
            _check_int("machine", key, a[key])
    if a["torch_hip"] is not None:
        _check_str("machine", "torch_hip", a["torch_hip"])
    _check_int("machine", "cpu_count", a["cpu_count"])
    for key in ("imported", "gpu_initialized", "nvml_notes"):
        names = a[key]
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise _bad(key, names, "a list of strings")
    for key in ("imported", "gpu_initialized"):
        if not set(a[key]) <= {"torch", "tensorflow", "keras"}:
            raise _bad(key, a[key], "names out of torch, tensorflow, keras")
    for key in ("torch", "torch_cuda", "torch_nccl", "tensorflow", "tf_cuda", "tf_nccl", "keras",
                "driver", "nvml_error"):
        if a[key] is not None:
            _check_str("machine", key, a[key])
    for key in ("torch_archs", "tf_archs"):
        archs = a[key]
        if isinstance(archs, str) or not isinstance(archs, Sequence) or not all(
                isinstance(x, str) for x in archs):
            raise _bad(key, archs, 'a list of arch names like ["sm_80", "compute_90"]')


def _physical_gpus(gpus: object, described: object, name: str, cc: tuple[int, int],
                   memory_gb: float) -> tuple[Gpu, ...]:
    """The physical GPUs of ``gpus`` (a count, or the `gpu` values ``described``), by index."""
    if isinstance(gpus, int) and not isinstance(gpus, bool):
        if gpus < 0:
            raise _bad("gpus", gpus, "a GPU count (0 or more) or a list of gpu() values")
        return tuple(gpu(i, name, cc, memory_gb) for i in range(gpus))
    if isinstance(described, Sequence) and not isinstance(described, str) and all(
        isinstance(g, Gpu) for g in described
    ):
        physical = tuple(sorted(described, key=_physical_index))
        indices = [_physical_index(g) for g in physical]
        if len(set(indices)) != len(indices):
            raise _bad("gpus", indices, "GPUs with distinct indices")
        return physical
    raise _bad("gpus", gpus, "a GPU count (0 or more) or a list of gpu() values")


def _visible(a: Mapping[str, Any], physical: tuple[Gpu, ...], env_map: Mapping[str, str]
             ) -> tuple[tuple[Gpu, ...], tuple[Link, ...], Link | None, Visibility]:
    """The GPUs this process sees (``CUDA_VISIBLE_DEVICES`` applied as CUDA does), their links,
    the fabric link and the visibility, from the physical GPUs and `machine`'s arguments."""
    nvlink, topology, p2p = a["nvlink"], a["topology"], a["p2p"]
    indices = [_physical_index(g) for g in physical]
    per_pair = _link_specs(a["links"], indices, nvlink, topology, p2p)
    instances = _mig_counts(a["mig"], indices)
    # a uniform machine past FABRIC_MIN_GPUS: its one kind of link, never N^2 of them
    uniform = not per_pair and not instances and len(physical) > FABRIC_MIN_GPUS
    physical_links: list[Link] = []
    for i, ga in enumerate(() if uniform else physical):
        for gb in physical[i + 1:]:
            pa, pb = _physical_index(ga), _physical_index(gb)
            n, top, p2p_read = per_pair.get((pa, pb), (nvlink, topology, p2p))
            physical_links.append(Link(pa, pb, topology=top, nvlinks=n, p2p_read=p2p_read,
                                       p2p_nvlink="ok" if n else "not_supported"))
    parents = _parents(physical, instances)
    resolution = resolve_visible_devices(
        env_map.get("CUDA_VISIBLE_DEVICES"), parents,
        device_order=env_map.get("CUDA_DEVICE_ORDER"),
    )
    by_index = {p.index: p for p in parents}
    gs = tuple(job_gpu(i, d, by_index[d.physical]) for i, d in enumerate(resolution.devices))
    numa_of = _gpu_numa(a["gpu_numa"], physical)
    gs = tuple(replace(g, numa_node=numa_of.get(g.physical_index)) for g in gs)
    visible_links, fabric = compact_links(len(gs), renumber_links(resolution.devices,
                                                                  physical_links))
    if uniform:
        fabric = Link(0, 0, topology=topology, nvlinks=nvlink, p2p_read=p2p,
                      p2p_nvlink="ok" if nvlink else "not_supported")
    return gs, visible_links, fabric, resolution.visibility


def _parents(physical: Sequence[Gpu], instances: Mapping[int, int]) -> list[PhysicalGpu]:
    """The physical GPUs as NVML lists them, with their MIG instances."""
    return [
        PhysicalGpu(
            index=_physical_index(g), uuid=g.uuid, name=g.name,
            compute_capability=g.compute_capability, memory_bytes=g.memory_bytes,
            memory_free_bytes=g.memory_free_bytes, nvlinks_outside=g.nvlinks_outside,
            pci_bus_id=g.pci_bus_id, mig_enabled=g.mig_enabled or _physical_index(g) in instances,
            mig=tuple(
                MigDevice(uuid=f"MIG-fake-{_physical_index(g):04d}-{k}", name=f"{g.name} MIG {k}",
                          memory_bytes=g.memory_bytes // instances[_physical_index(g)],
                          gpu_instance=k, compute_instance=0)
                for k in range(instances.get(_physical_index(g), 0))
            ),
        )
        for g in physical
    ]


def _host(a: Mapping[str, Any], host_memory: int | None) -> Host:
    """The host of `machine`'s arguments."""
    shm_mb = a["shm_mb"]
    return Host(shm_bytes=None if shm_mb is None else shm_mb << 20, container=a["container"],
                wsl2=a["wsl2"], sagemaker=a["sagemaker"], aws=a["aws"], efa=a["efa"],
                iommu=a["iommu"], infiniband=a["infiniband"], kernel=a["kernel"],
                cpu_count=a["cpu_count"], platform=a["platform"],
                memory_available_bytes=host_memory, machine=a["cpu_arch"],
                numa_nodes=a["numa_nodes"], numa_memory_only=a["numa_memory_only"],
                amd_gpus=a["amd_gpus"], cuda_compat=a["cuda_compat"],
                port_range=a["port_range"])


def _frameworks(a: Mapping[str, Any]) -> tuple[FrameworkInfo, ...]:
    """The installed frameworks of `machine`'s arguments, with what this process imported."""
    fws = []
    if a["torch"]:
        fws.append(FrameworkInfo("torch", a["torch"], "torch", a["torch_cuda"], a["torch_nccl"],
                                 tuple(a["torch_archs"]), hip=a["torch_hip"]))
    if a["tensorflow"]:
        dist = "tensorflow" if a["tf_cuda"] else "tensorflow-cpu"
        fws.append(FrameworkInfo("tensorflow", a["tensorflow"], dist, a["tf_cuda"], a["tf_nccl"],
                                 tuple(a["tf_archs"])))
    if a["keras"]:
        fws.append(FrameworkInfo("keras", a["keras"], "keras"))
    imported, started = a["imported"], a["gpu_initialized"]
    return tuple(replace(f, imported=f.name in imported or f.name in started,
                         gpu_initialized=f.name in started) for f in fws)


def _with_nodes(facts: Facts, nodes: Sequence[Mapping[str, Any]]) -> Facts:
    """``facts`` (node 0) with the described other nodes (`machine`'s ``nodes``)."""
    from ..core.knowledge.nodefacts import node_env, node_facts
    from ..core.values.facts import NodeFacts

    if isinstance(nodes, (str, Mapping)) or not all(isinstance(n, Mapping) for n in nodes):
        raise _bad("nodes", nodes, "a list of objects, one per node after node 0")
    first = node_facts(facts, "torch", 0, "node0")
    out = [first]
    for k, described in enumerate(nodes, 1):
        d = dict(described)
        env = dict(first.env)
        changed = d.pop("env", None) or {}
        if not isinstance(changed, Mapping):
            raise _bad("nodes", described, 'an "env" object of variables')
        for name, value in changed.items():
            if value is None:
                env.pop(str(name), None)
            else:
                env[str(name)] = str(value)
        try:
            out.append(NodeFacts.from_dict({**first.to_dict(), "host": f"node{k}", **d,
                                            "node": k, "env": node_env(env.items())}))
        except (TypeError, ValueError) as exc:
            raise _bad("nodes", described, f"fields of NodeFacts ({exc})") from None
    return replace(facts, nodes=tuple(out))


def _gpu_numa(gpu_numa: Sequence[int] | None, physical: Sequence[Gpu]) -> dict[int, int | None]:
    """Each physical GPU's NUMA node: from ``gpu_numa`` (NVML order), else from `gpu`."""
    if gpu_numa is None:
        return {_physical_index(g): g.numa_node for g in physical}
    if isinstance(gpu_numa, str) or not isinstance(gpu_numa, Sequence) or len(gpu_numa) != len(
            physical) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                 for n in gpu_numa):
        raise _bad("gpu_numa", gpu_numa, f"one NUMA node (0 or more) per GPU ({len(physical)})")
    return {_physical_index(g): n for g, n in zip(physical, gpu_numa, strict=True)}


def _platform_value(value: Platform | Mapping[str, Any] | None) -> Platform:
    if value is None or isinstance(value, Platform):
        return value or Platform()
    if not isinstance(value, Mapping):
        raise _bad("platform_facts", value, "a Platform value or a mapping of its fields")
    try:
        return Facts.from_dict({"platform": dict(value)}).platform
    except (TypeError, ValueError) as exc:
        raise _bad("platform_facts", value, f"Platform fields ({exc})") from None


# ----- argument checks for gpu() / machine() -----------------------------------------------------
def _bad(field_name: str, value: object, expected: str, where: str = "machine") -> InvalidOptionError:
    return InvalidOptionError(f"{where}({field_name}=...): expected {expected}, not {value!r}")


def _physical_index(g: Gpu) -> int:
    return g.physical_index if g.physical_index >= 0 else g.index


def _check_int(where: str, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(key, value, "an integer, 0 or more", where)
    return value


def _check_bool(where: str, key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _bad(key, value, "true or false", where)
    return value


def _check_str(where: str, key: str, value: object) -> str:
    if not isinstance(value, str):
        raise _bad(key, value, "a string", where)
    return value


def _check_choice(key: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise _bad(key, value, f"one of {', '.join(choices)}")


def _number(where: str, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise _bad(key, value, "a number, 0 or more", where)
    return float(value)


def _cc(where: str, value: object) -> tuple[int, int]:
    if (
        isinstance(value, (tuple, list)) and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        return (value[0], value[1])
    raise _bad("cc", value, "a compute capability as two integers, like (9, 0) or [9, 0]", where)


def _string_map(key: str, value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise _bad(key, value, "a mapping of variable names to string values")
    return dict(value)


def _link_specs(
    links: Mapping[tuple[int, int] | str, int | Mapping[str, Any]] | None,
    indices: Sequence[int], nvlink: int, topology: str, p2p: str,
) -> dict[tuple[int, int], tuple[int, str, str]]:
    """``links`` as {(a, b): (NVLink count, PCIe topology, P2P status)} with a < b, every index
    one of ``indices``; what a pair does not say is the machine-wide value."""
    if links is None:
        return {}
    if not isinstance(links, Mapping):
        raise _bad("links", links, 'a mapping like {(0, 1): 4} or {"0-1": 4}')
    out: dict[tuple[int, int], tuple[int, str, str]] = {}
    for key, spec in links.items():
        pair: tuple[int, ...] = ()
        if isinstance(key, str):
            a, sep, b = key.partition("-")
            if sep and a.strip().isdigit() and b.strip().isdigit():
                pair = (int(a), int(b))
        elif isinstance(key, (tuple, list)) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in key
        ):
            pair = tuple(key)
        if len(pair) != 2 or pair[0] == pair[1] or not set(pair) <= set(indices):
            raise _bad("links", key, f"a pair of two different GPU indices out of {list(indices)}, "
                                     'like (0, 1) or "0-1"')
        fields_ = dict(spec) if isinstance(spec, Mapping) else {"nvlinks": spec}
        if not set(fields_) <= {"nvlinks", "topology", "p2p"}:
            raise _bad("links", spec, 'an NVLink count or {"nvlinks", "topology", "p2p"}')
        count = fields_.get("nvlinks", nvlink)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise _bad("links", count, f"an NVLink count (0 or more) for {key!r}")
        top, status = fields_.get("topology", topology), fields_.get("p2p", p2p)
        _check_choice("links topology", top, TOPOLOGY_LEVELS)
        _check_choice("links p2p", status, P2P_STATUSES)
        out[(min(pair), max(pair))] = (count, str(top), str(status))
    return out


def _mig_counts(mig: Mapping[int | str, int] | None, indices: Sequence[int]) -> dict[int, int]:
    """``mig`` as {physical index: MIG instances (1 or more)}; JSON keys may be strings."""
    if mig is None:
        return {}
    if not isinstance(mig, Mapping):
        raise _bad("mig", mig, 'a mapping of GPU index to MIG instance count, like {"0": 2}')
    out: dict[int, int] = {}
    for key, count in mig.items():
        index = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if isinstance(index, bool) or not isinstance(index, int) or index not in indices:
            raise _bad("mig", key, f"a GPU index out of {list(indices)}")
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 7:
            raise _bad("mig", count, "a MIG instance count from 1 to 7")
        out[index] = count
    return out


#: "ok", "ok:<GB/s>", "timeout", "error:<cause>", a result, or a result's fields as a mapping
#: (``{"status": "ok", "bus_bandwidth_gbps": 9.5, "message_bytes": 268435456, "step_seconds":
#: 0.01, "extra": [["value_check_iterations", "20"]]}``); a list of those is one per probe of
#: that key, in turn, the last one repeating (a retried probe that fails, then passes)
Outcome = str | ProbeResult | Mapping[str, Any] | Sequence[Any]


@dataclass
class SimulatedProber(Prober):
    """Answers probes from a table instead of running them, and records what was asked.

    Outcomes: "ok", "ok:<GB/s>", "timeout" (the commonest real hang: inside the first
    collective), "hang:<kind>" (a hang judged from progress: setup, collective, straggler,
    quiet), "error:<cause>",
    "fails:<text>" (what the failing worker printed, verbatim: the signature table places it,
    as it places a real probe's), "signal:<number>" (a worker killed by that signal); a list
    of outcomes answers the probes of its key in turn, the last one repeating.

    Keys: a backend with no extra environment ("nccl", "gloo", "hierarchical_copy", ...; a
    sharded candidate's "nccl/fsdp" wins over "nccl" for it, an offloaded one's
    "nccl/fsdp+offload" over both; "nccl/fsdp@0,1" on GPUs 0 and 1 only wins over all); a
    backend with the exact environment of a remedy ("nccl+NCCL_P2P_DISABLE=1", several sorted
    and joined by ","); "nccl+*" for every remedy; "*" for everything. The most specific key
    wins; anything unmatched is ``default``.

    Each probe takes the seconds the real prober would spend on it (`probing.cost`): a
    healthy one its phases at typical figures for its class of machine (forking's saving
    included), a hang the start-up plus the allowance of the prober's own stall policy (a hang of
    TF across workers, which progress cannot judge, the whole timeout). The GPU health check is
    deferred exactly as the real prober's decision defers it (`probing.health.Unproven`):
    the decision calls `check_gpus`, which charges `probing.cost.health_check_seconds`
    and reports the GPUs of ``broken_gpus`` broken. `clock` advances by all of it, so the
    probe budget runs out as it would on the machine.
    """

    #: Read by the executor: the outcomes are described, not measured (said in the trace).
    simulated: ClassVar[bool] = True
    #: The GPU health check is deferred to the decision, as the real prober's is.
    defers_gpu_check: ClassVar[bool] = True

    outcomes: Mapping[str, Outcome] = field(default_factory=dict)
    default: Outcome = "ok"
    calls: list[ProbeSpec] = field(default_factory=list)
    elapsed_s: float = 0.0  # simulated seconds spent probing so far (see `clock`)
    #: the phase figures of the machine described (None: the typical ones of its class,
    #: `probing.cost.TYPICAL`), e.g. its measured framework import
    figures: cost.Figures | None = None
    #: GPUs (CUDA ordinals) the health check finds broken: {ordinal: what went wrong}
    broken_gpus: Mapping[int, str] = field(default_factory=dict)
    #: the GPUs of each health check the decision ran, in order
    health_checks: list[tuple[int, ...]] = field(default_factory=list)
    #: how many probes each key of a list of outcomes answered so far
    answered: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, out in self.outcomes.items():
            for one in _in_turn(out):
                _parse(key, one)  # validate early: a typo is an error, not a silent "ok"

    def check_gpus(self, framework: str, devices: tuple[int, ...],
                   env: Mapping[str, str]) -> list[tuple[int, str]]:
        """The GPU health check of ``devices``, as `probing.prober.DeferredHealthProber`
        runs it (torch's forked from the deciding process): charged to `clock`; the
        broken ones of `broken_gpus` with why."""
        self.elapsed_s += self.check_seconds(framework, len(devices), env)
        self.health_checks.append(tuple(devices))
        return [(d, self.broken_gpus[d]) for d in devices if d in self.broken_gpus]

    def check_seconds(self, framework: str, gpus: int, env: Mapping[str, str]) -> float:
        """What `check_gpus` charges for ``gpus`` GPUs now (the decision weighs it
        against the probe budget left)."""
        forked = framework == "torch" and forkserver.enabled(env)
        warm = any(c.framework == "torch" for c in self.calls)
        figures = self.figures or cost.TYPICAL[
            ("tensorflow" if framework == "tensorflow" else "torch", True)]
        return cost.health_check_seconds(framework, gpus, forked=forked, warm=warm,
                                          figures=figures)

    def probe(self, spec: ProbeSpec, env: Mapping[str, str]) -> ProbeResult:
        """The described outcome of ``spec``'s candidate, charged to `clock`."""
        warm = any(c.framework == "torch" for c in self.calls)  # the deciding process imported torch
        self.calls.append(spec)
        env_key = ",".join(f"{k}={v}" for k, v in spec.env)
        # a sharded candidate's own outcome ("nccl/fsdp") wins over its backend's ("nccl")
        sharded = spec.backend + SHARDED_MARK
        names = [sharded, spec.backend] if spec.sharded else [spec.backend]
        if spec.identity.offload:  # its own outcome wins again
            names.insert(0, sharded + OFFLOAD_MARK)
        if spec.identity.node_local:  # node 0 alone: its own outcome
            names.insert(0, spec.backend + NODE0_MARK)
        if spec.devices:  # "nccl/fsdp@0,1": on these GPUs only (the most specific)
            on = ",".join(map(str, spec.devices))
            names = [*(f"{n}@{on}" for n in names), *names]
        keys = [k for n in names for k in ((f"{n}+{env_key}", f"{n}+*") if env_key else (n,))]
        key = next((k for k in (*keys, "*") if k in self.outcomes), None)
        out = self.default if key is None else self.outcomes[key]
        turns = _in_turn(out)
        if len(turns) > 1 and key is not None:  # one per probe of this key, the last repeating
            n = self.answered.get(key, 0)
            self.answered[key] = n + 1
            out = turns[min(n, len(turns) - 1)]
        res = _parse(spec.candidate, out)
        ending = _ending(spec, out, res)
        if ending is None:  # an error, or a result with its own elapsed time: as described
            res = replace(res, elapsed_s=min(res.elapsed_s, spec.timeout_s))
        else:  # the real prober's clock: start-up, phases, a hang cut from progress
            forked = spec.framework == "torch" and forkserver.enabled(env)
            res = replace(res, elapsed_s=cost.probe_seconds(spec, ending, forked=forked,
                                                             warm=warm, figures=self.figures,
                                                             env=env))
            if ending == "collective" and not res.extra:  # a plain "timeout", as judged
                res = replace(res, detail="simulated hang (collective)",
                              extra=(("hang", "collective"),))
        self.elapsed_s += res.elapsed_s
        return res

    def clock(self) -> float:
        """A monotonic clock that advances by each simulated probe's duration, so the executor's
        probe budget runs out in a simulation exactly as it would on the machine."""
        return self.elapsed_s

    @property
    def probed(self) -> list[str]:
        """What was probed, in order, as "backend" or "backend+ENV=1"."""
        return [
            s.backend + (SHARDED_MARK if s.sharded else "")
            + ("+" + ",".join(f"{k}={v}" for k, v in s.env) if s.env else "")
            for s in self.calls
        ]


def _in_turn(out: Outcome) -> list[Any]:
    """The outcomes a key answers in turn: a list's items, else the one outcome."""
    if isinstance(out, Sequence) and not isinstance(out, (str, ProbeResult)):
        if not out:
            raise ValueError("probe outcome []: a list of outcomes needs at least one")
        return list(out)
    return [out]


def _ending(spec: ProbeSpec, out: Outcome, res: ProbeResult) -> str | None:
    """How the simulated probe ends, for its cost (`probing.cost`); None: its described
    elapsed time stands (an error, or a result or mapping that gives ``elapsed_s``)."""
    if isinstance(out, ProbeResult) or (isinstance(out, Mapping) and "elapsed_s" in out):
        return None
    if res.status == OK:
        return "ok"
    if res.status != TIMEOUT:
        return None
    kind = dict(res.extra).get("hang", "collective")  # "timeout": the commonest real hang
    return kind if cost.judged_by_progress(spec) and kind in cost.HANG_KINDS else "deadline"


def _parse(candidate: str, out: Outcome) -> ProbeResult:
    if isinstance(out, ProbeResult):
        return ProbeResult.from_dict({**out.to_dict(), "candidate": candidate})
    if isinstance(out, Mapping):  # every field a probe can report (JSON: ProbeResult.to_dict())
        return ProbeResult.from_dict({"elapsed_s": 2.0, "detail": "simulated", **out,
                                      "candidate": candidate})
    if not isinstance(out, str):
        raise ValueError(f"probe outcome {out!r}: a string or an object of probe result fields")
    kind, _, arg = out.partition(":")
    if kind == OK:  # checked as the object form is: a finite, non-negative GB/s
        try:
            bw = float(arg) if arg else None
        except ValueError:
            raise ValueError(f"probe outcome {out!r}: 'ok:<GB/s>' takes a number") from None
        return ProbeResult.from_dict({"candidate": candidate, "status": OK, "elapsed_s": 2.0,
                                      "bus_bandwidth_gbps": bw, "detail": "simulated"})
    if kind == TIMEOUT:
        return ProbeResult(candidate, TIMEOUT, 30.0, "timeout", "simulated hang")
    if kind == "hang" and arg in HANG_KINDS:  # a hang judged from progress, cut early
        return ProbeResult(candidate, TIMEOUT, 8.0, "timeout", f"simulated hang ({arg})",
                           extra=(("hang", arg),))
    if kind == ERROR and arg in CAUSES:
        return ProbeResult(candidate, ERROR, 1.0, arg, "simulated failure")
    if kind == "fails" and arg.strip():
        return _as_reported(candidate, WorkerOutcome(
            0, 1, report=json.dumps({"status": "error", "error": arg}), failed_first=True))
    if kind == "signal" and arg.isdigit() and 1 <= int(arg) <= 64:
        return _as_reported(candidate, WorkerOutcome(0, -int(arg), signal=int(arg),
                                                     failed_first=True))
    raise ValueError(
        f"probe outcome {out!r}: use 'ok', 'ok:<GB/s>', 'timeout', 'hang:<kind>' with a kind in "
        f"{list(HANG_KINDS)} (a hang cut early, from progress), 'error:<cause>' with a cause "
        f"in {sorted(c for c in CAUSES if c)}, 'fails:<the text the failure printed>' (placed "
        "by the signature table) or 'signal:<number>' (a worker killed by that signal)"
    )


def _as_reported(candidate: str, outcome: WorkerOutcome) -> ProbeResult:
    """What the probe parser makes of one failed worker, through the signature table (the
    built-in one), exactly as a real probe's result is made."""
    spec = ProbeSpec(candidate, "torch", "nccl", ())
    return replace(parse_probe(spec, [outcome], 1.0, False), stderr_tail="")


FakeProber = SimulatedProber  # the testing kit's name for it


#: Fields of a simulation file (``resilient-strategy --simulate``, examples/machines).
SIMULATION_KEYS = frozenset({
    "what", "framework", "global_batch_size", "gradient_bytes", "sample_seconds", "machine",
    "facts", "probes", "expect",
    # a field case (examples/machines/field/): where it was reported, its family, its kind (one
    # of FIELD_KINDS), what it said
    "source", "family", "kind", "reported",
    "param_bytes", "optimizer_state_factor", "sharding", "offload",
    # GPUs the health check finds broken: {"<CUDA ordinal>": "what went wrong"} (a wedged GPU)
    "broken_gpus",
})
#: The kinds of field case (issue 31's, what goes wrong as a user meets it): a probe that hangs
#: with no error text, a probe that passes where training breaks, versions with known faults,
#: nodes that differ or cannot talk, pods and containers, drivers and builds that are not what
#: they seem, error texts, inspection that blocks. `benchmarks/bench_field.py` totals by them.
FIELD_KINDS = ("silent_hang", "probe_vs_training", "versions", "nodes", "pods_containers",
               "drivers_builds", "error_texts", "inspection")
#: Fields of a machine case's ``expect`` block (the decision it must reach; tests replay it).
EXPECT_KEYS = frozenset({
    "backend", "devices", "num_replicas", "accumulation_steps", "per_replica_batch_size", "env",
    "probed", "rules_fired", "explain_contains",
    "notes",  # topics of the trace's notes the decision must say (``mig_one_slice``)
    "causes",  # {probe key: the cause its failure was placed on}, e.g. {"nccl": "nvls_multicast"}
    "sharded", "ladder", "ruled_out_by_memory",
    "offload",  # the chosen candidate offloads its state to the host
    # ids of the differences between the nodes found before any probe (``nodes_differ``)
    "findings",
    # no decision: the typed error it ends in, {"type": "ModelDoesNotFitError", ...its fields}
    "error",
})


def load_simulation(path: Path) -> tuple[Facts, dict[str, Any]]:
    """A ``--simulate`` file: the described machine and the rest of the file; every problem is one clean error that
    names the file and the field."""
    try:
        data = files.read_json(path, max_bytes=files.MAX_MACHINE_BYTES, owned=False)
    except (OSError, ResilientStrategyError) as exc:  # too large, too deep, not JSON, a FIFO
        raise ResilientStrategyError(f"cannot read --simulate file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ResilientStrategyError(f"{path}: expected a JSON object")
    described = "machine" in data or "facts" in data
    if not described and "gpus" not in data:
        raise ResilientStrategyError(
            f'{path}: describe the machine: a "machine" object (the fields of '
            'resilient_strategy.testing.simulation.DescribedMachine, at least "gpus") or a "facts" object (the '
            'Facts.to_dict() form, at least "gpus" and "frameworks")')
    unknown = sorted(set(data) - SIMULATION_KEYS) if described else []
    if unknown:
        raise ResilientStrategyError(
            f"{path}: unknown field(s) {unknown}; allowed: {sorted(SIMULATION_KEYS)}")
    _check_simulation_fields(path, data)
    _check_bounds(path, data)
    try:
        if "machine" in data:
            facts = DescribedMachine.from_mapping(data["machine"]).facts()
        else:
            raw = data.get("facts", data)
            _check_facts_shape(raw)
            facts = Facts.from_dict(raw)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
        raise ResilientStrategyError(f"{path}: not a machine description: {exc}") from exc
    probes = data.get("probes")
    if probes is not None:
        if not isinstance(probes, dict) or not all(
            isinstance(k, str) and (isinstance(v, (str, dict)) or (
                isinstance(v, list) and all(isinstance(x, (str, dict)) for x in v)))
            for k, v in probes.items()
        ):
            raise ResilientStrategyError(
                f'{path}: probes: expected an object of outcomes like {{"nccl": "timeout"}} or '
                f'{{"nccl": {{"status": "ok", "bus_bandwidth_gbps": 9.5}}}} (a list of them: '
                f'one per probe in turn), not {probes!r}')
        try:
            SimulatedProber(dict(probes))
        except ValueError as exc:
            raise ResilientStrategyError(f"{path}: probes: {exc}") from exc
    return facts, data


def _check_facts_shape(raw: Any) -> None:
    """Every field of a "facts" description has the JSON type the Facts.to_dict() form has, so
    that a wrong one is named (not "'int' object is not iterable")."""
    reference = json.loads(json.dumps(machine(2, tensorflow="2.15.1").to_dict(), default=str))
    if not isinstance(raw, dict):
        raise ValueError(f"facts: expected an object, not {raw!r}")
    for key in ("gpus", "frameworks"):
        if key not in raw:
            raise ValueError(f"facts: {key!r} is required (a list; [] for none)")

    def kind(v: Any) -> str:
        return ("null" if v is None else "bool" if isinstance(v, bool) else "number"
                if isinstance(v, (int, float)) else "string" if isinstance(v, str) else "list"
                if isinstance(v, list) else "object" if isinstance(v, dict) else type(v).__name__)

    def check(where: str, value: Any, ref: Any) -> None:
        if value is None or ref is None:
            return
        if kind(value) != kind(ref):
            article = "an" if kind(ref)[0] in "aeiou" else "a"
            raise ValueError(f"{where}: expected {article} {kind(ref)}, not {value!r}")
        if isinstance(ref, dict):
            for k, v in value.items():
                if k in ref:
                    check(f"{where}.{k}", v, ref[k])
        elif isinstance(ref, list) and ref:
            for i, v in enumerate(value):
                check(f"{where}[{i}]", v, ref[0])

    for key, value in raw.items():
        if key in reference:
            check(f"facts.{key}", value, reference[key])


#: The most GPUs a described machine may have (one host: 8 to 16 today; an NVLink domain of
#: 72). Planning is quadratic in the GPUs (their links): 256 plan in well under a second.
MAX_SIMULATED_GPUS = 256
#: Every number of a described machine lies within this (integers exact in a float), so that
#: no size in bytes becomes an infinity (memory_gb 1e300) or takes minutes.
MAX_SIMULATED_NUMBER = 2.0**53


def _check_bounds(path: Path, data: Mapping[str, Any]) -> None:
    """The described machine is bounded: at most MAX_SIMULATED_GPUS GPUs, every number finite
    and within MAX_SIMULATED_NUMBER. One clean error naming the file and the field."""
    for key in ("machine", "facts"):
        described = data.get(key)
        if not isinstance(described, dict):
            continue
        gpus = described.get("gpus")
        count = gpus if isinstance(gpus, int) and not isinstance(gpus, bool) else \
            len(gpus) if isinstance(gpus, list) else 0
        if not 0 <= count <= MAX_SIMULATED_GPUS:
            raise ResilientStrategyError(
                f"{path}: {key}.gpus: expected 0 to {MAX_SIMULATED_GPUS} GPUs, not {count}")
        links = described.get("links")
        if isinstance(links, (list, dict)) and len(links) > count * (count - 1) // 2 + 1:
            raise ResilientStrategyError(
                f"{path}: {key}.links: {len(links)} links for {count} GPUs")
        bad = _out_of_range(described, key)
        if bad is not None:
            raise ResilientStrategyError(
                f"{path}: {bad[0]}: expected a finite number within "
                f"+-{MAX_SIMULATED_NUMBER:.0f}, not {bad[1]!r}")


def _out_of_range(value: Any, where: str) -> tuple[str, Any] | None:
    """The first number (with where it is) that is not finite or is out of range, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        ok = math.isfinite(value) and abs(value) <= MAX_SIMULATED_NUMBER
        return None if ok else (where, value)
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else ()
    for k, v in items:
        found = _out_of_range(v, f"{where}.{k}" if isinstance(k, str) else f"{where}[{k}]")
        if found is not None:
            return found
    return None


def _check_simulation_fields(path: Path, data: Mapping[str, Any]) -> None:
    framework = data.get("framework")
    if framework is not None and framework not in FRAMEWORKS:
        raise ResilientStrategyError(
            f"{path}: framework: expected one of {FRAMEWORKS}, not {framework!r}")
    for key in ("global_batch_size", "gradient_bytes", "param_bytes"):
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ResilientStrategyError(f"{path}: {key}: expected a positive integer, not {value!r}")
    kind = data.get("kind")
    if kind is not None and kind not in FIELD_KINDS:
        raise ResilientStrategyError(f"{path}: kind: expected one of {FIELD_KINDS}, not {kind!r}")
    broken = data.get("broken_gpus")
    if broken is not None and (not isinstance(broken, dict) or not all(
            isinstance(k, str) and k.isdigit() and isinstance(v, str) for k, v in broken.items())):
        raise ResilientStrategyError(
            f'{path}: broken_gpus: expected an object like {{"0": "what went wrong"}} (CUDA '
            f"ordinals the GPU health check finds broken), not {broken!r}")
    expect = data.get("expect")
    if expect is not None and (not isinstance(expect, dict) or not set(expect) <= EXPECT_KEYS):
        raise ResilientStrategyError(
            f"{path}: expect: expected an object with fields from {sorted(EXPECT_KEYS)}, not "
            f"{expect!r}")
    seconds = data.get("sample_seconds")
    if seconds is not None and (
        isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0
    ):
        raise ResilientStrategyError(
            f"{path}: sample_seconds: expected a positive number, not {seconds!r}")
