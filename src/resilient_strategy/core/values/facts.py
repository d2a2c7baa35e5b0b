"""The inspected facts: a frozen snapshot of the GPUs, links, host and frameworks.

Longer than ~450 lines on purpose: the one frozen value of the machine (GPUs, links and the
fabric, host, platform, frameworks) with its lookups, JSON form and fingerprint.

Everything downstream (rules, planner, cache, doctor) takes a `Facts` value as a parameter.
Facts round-trip through plain JSON (``to_dict`` / ``from_dict``) so a machine can be described in a
file (``doctor --simulate``) or in a user's unit test.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from operator import attrgetter
from typing import Any

#: Values of NVML's topology common ancestor, nearest first (nvmlGpuTopologyLevel_t).
TOPOLOGY_LEVELS = ("internal", "single", "multiple", "hostbridge", "node", "system", "unknown")

#: Values of NVML's P2P status (nvmlGpuP2PStatus_t), as words.
P2P_STATUSES = (
    "ok",
    "chipset_not_supported",
    "gpu_not_supported",
    "iohub_topology_not_supported",
    "disabled_by_regkey",
    "not_supported",
    "unknown",
)

#: Environment variables that change what NCCL / the frameworks do; part of the fingerprint
#: (less `_PER_RUN_ENV`). TensorFlow's are named one by one: a "TF_" prefix would take in
#: Terraform's TF_CLI_CONFIG_FILE, TF_LOG, ... and TensorFlow's log levels.
RELEVANT_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "GLOO_", "NVSHMEM_")
RELEVANT_ENV_NAMES = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "SM_HOSTS",
    "SM_CURRENT_HOST",
    "TF_CONFIG",
    "TF_FORCE_GPU_ALLOW_GROWTH",
    "TF_GPU_ALLOCATOR",
    "TF_GPU_THREAD_MODE",
    "TF_GPU_THREAD_COUNT",
    "TF_XLA_FLAGS",
    "FI_PROVIDER",
    "FI_EFA_USE_DEVICE_RDMA",
    "CLIENT_API_TYPE",  # NVFlare's launcher mode (seed 004)
)


#: Relevant variables left out of the fingerprint: they differ between runs of the same job on
#: the same machine (ranks, rendezvous, launch size: results are keyed by candidate, which names
#: the devices, and `python -m resilient_strategy probe` must warm the cache a torchrun job reads)
#: or only change what NCCL logs (turning debug output on must not force a re-probe). Every
#: relevant variable a launcher sets on its own belongs here, else a cache warmed from the
#: command line never serves the launched job: torchrun sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1
#: (NCCL_ASYNC_ERROR_HANDLING before torch 2.2), which changes how a failed collective is
#: reported, not whether it works. (Its other variables, OMP_NUM_THREADS, GROUP_*, ROLE_*,
#: TORCHELASTIC_*, are not relevant at all; tests/test_facts.py checks a real torchrun's.)
_PER_RUN_ENV = frozenset(
    {"RANK", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "TORCHELASTIC_RUN_ID",
     "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NCCL_DEBUG", "NCCL_DEBUG_FILE", "NCCL_DEBUG_SUBSYS",
     "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"}
)


@dataclass(frozen=True)
class Gpu:
    """One GPU the job can see. ``index`` is the CUDA ordinal inside the job (0..n-1)."""

    index: int
    name: str
    compute_capability: tuple[int, int]
    memory_bytes: int = 0
    uuid: str = ""
    pci_bus_id: str = ""
    physical_index: int = -1
    mig_enabled: bool = False
    #: Free memory when inspected (NVML ``nvmlDeviceGetMemoryInfo().free``); None: unknown.
    memory_free_bytes: int | None = None
    #: Active NVLinks of this GPU to GPUs this process cannot see at all (NVML does not list
    #: them: a pod or container given one of a host's NVLinked GPUs); 0 none or unknown.
    nvlinks_outside: int = 0
    #: The host NUMA node the GPU hangs off (``/sys/bus/pci/devices/<bdf>/numa_node``); None:
    #: unknown or none reported (the kernel writes -1 on a machine without NUMA).
    numa_node: int | None = None

    @property
    def cc(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"

    @property
    def is_consumer(self) -> bool:
        """GeForce / workstation-consumer boards whose PCIe P2P is often claimed but broken."""
        n = self.name.lower()
        return "geforce" in n or " rtx 40" in n or " rtx 50" in n or "rtx 6000 ada" in n or (
            "titan" in n
        )


@dataclass(frozen=True)
class Link:
    """What connects two visible GPUs ``a < b``. PCIe path and NVLink are separate facts."""

    a: int
    b: int
    topology: str = "unknown"  # one of TOPOLOGY_LEVELS
    nvlinks: int = 0  # active NVLinks from a that land on b
    p2p_read: str = "unknown"  # one of P2P_STATUSES
    p2p_nvlink: str = "unknown"


@dataclass(frozen=True)
class Host:
    """Host facts that decide NCCL transports."""

    shm_bytes: int | None = None  # size of /dev/shm; None when unknown
    container: str = ""  # "docker", "podman", "kubernetes", "containerd", "" when none seen
    wsl2: bool = False
    sagemaker: bool = False
    aws: bool = False
    efa: bool = False  # an EFA device is present
    infiniband: bool = False  # an IB/RoCE device is present (/sys/class/infiniband)
    iommu: str = "unknown"  # "on", "off", "unknown"
    kernel: str = ""
    cpu_count: int = 1
    platform: str = "linux"
    #: Host memory available to new processes (/proc/meminfo MemAvailable); None: unknown.
    memory_available_bytes: int | None = None
    #: The CPU architecture (``platform.machine()``: "x86_64", "aarch64", "arm64"); "" unknown.
    machine: str = ""
    #: NUMA nodes that hold memory (``/sys/devices/system/node/node*``); None: unknown.
    numa_nodes: int | None = None
    #: Of those, the nodes with memory and no CPU (CXL or HBM expanders, Grace's GPU memory):
    #: CUDA's host-NUMA allocations can fail on them; None: unknown.
    numa_memory_only: int | None = None
    #: AMD GPUs the ROCm kernel driver lists (``/sys/class/kfd/kfd/topology/nodes/*`` with
    #: SIMDs); None: no kfd (no ROCm driver) or unreadable.
    amd_gpus: int | None = None
    #: The CUDA forward-compatibility driver installed in this image (the version of
    #: ``/usr/local/cuda*/compat/libcuda.so.<version>``, "" none seen): it lets a newer CUDA run
    #: on an older host driver on data-center GPUs, and fails with error 804 on others.
    cuda_compat: str = ""
    #: The kernel's ephemeral port range (``net.ipv4.ip_local_port_range``), "" unknown.
    port_range: str = ""
    #: Who chose ``MASTER_PORT``: "launcher" (torchrun's elastic agent picked it, a free port
    #: the kernel gave, and its store already listens there: nothing of the job binds it
    #: again), "user" (set outside a launcher's store, or given to the launcher as
    #: ``--master-port`` / ``PET_MASTER_PORT``), "" (no MASTER_PORT, or not read).
    master_port_by: str = ""


#: Link layers of an RDMA port (``/sys/class/infiniband/*/ports/*/link_layer``).
RDMA_LINK_LAYERS = ("", "infiniband", "ethernet")


@dataclass(frozen=True)
class Platform:
    """Facts of the platform around the GPUs that decide a remedy: NVSwitch fabric, hypervisor,
    RDMA link layer, the route to the job's MASTER_ADDR. ``None`` / ``""`` mean unknown (no
    remedy gated on it applies)."""

    nvswitch: bool | None = None  # NVSwitches present (an HGX board): NVLS can apply
    hypervisor: str = ""  # "kvm", "vmware", "hyperv", "xen", ... ("" none seen)
    rdma_link_layer: str = ""  # one of RDMA_LINK_LAYERS: "ethernet" is RoCE
    rdma_devices: tuple[str, ...] = ()  # HCA names, e.g. ("mlx5_0", "mlx5_1")
    master_ifname: str = ""  # the interface whose route reaches MASTER_ADDR
    #: how ``master_ifname`` was found, or why it is unknown ("" with no MASTER_ADDR set)
    master_route: str = ""
    hostname_loopback: bool | None = None  # the hostname resolves to 127.x / ::1
    #: the installed nvidia-fabricmanager package's version ("" unknown or none): on NVSwitch
    #: systems it must equal the driver's, or the fabric manager does not start (CUDA error 802)
    fabric_manager: str = ""
    #: NCCL network plugins found (``libnccl-net*.so`` file names, and ``NCCL_NET_PLUGIN``'s
    #: library where it names one that exists); () none found or unknown
    net_plugins: tuple[str, ...] = ()
    #: the address family ``MASTER_ADDR`` resolves to here: "ipv4", "ipv6" ("" not set/unknown)
    master_family: str = ""
    #: the kernel's boot id (``/proc/sys/kernel/random/boot_id``, shared by every container on
    #: one host): two "nodes" with the same one are pods or containers of one host ("" unknown)
    boot_id: str = ""


@dataclass(frozen=True)
class FrameworkInfo:
    """A framework as seen without importing it (and whether it is imported / initialized)."""

    name: str  # "torch", "tensorflow", "keras"
    version: str | None = None  # None: not installed
    distribution: str = ""  # e.g. "tensorflow-cpu"
    cuda: str | None = None  # CUDA version it was built with; None for CPU builds / unknown
    nccl: str | None = None  # NCCL version it will use, where knowable
    archs: tuple[str, ...] = ()  # compiled GPU architectures, e.g. ("sm_80", "compute_90")
    imported: bool = False
    gpu_initialized: bool = False
    imported_at: str | None = None  # "file:line" of the first import, when watched
    #: The HIP (ROCm) version a ROCm build was made for (``torch.version.hip``); None otherwise
    hip: str | None = None

    @property
    def installed(self) -> bool:
        return self.version is not None

    @property
    def build(self) -> str:
        """What the installed build runs on: "cuda", "rocm", "cpu" ("" not installed). A
        ROCm build of torch is not CPU-only: its ``torch.cuda`` runs AMD GPUs through HIP."""
        if self.version is None:
            return ""
        if self.cuda is not None:
            return "cuda"
        if self.hip is not None or "+rocm" in self.version:
            return "rocm"
        return "cpu"

    @property
    def has_cuda(self) -> bool:
        return self.cuda is not None


@dataclass(frozen=True)
class NodeFacts:
    """What one node of a multi-node job says about itself, compared by node 0 before any probe
    (`resilient_strategy.core.knowledge.nodefacts`). Built from that node's `Facts` and crossing the
    job's store as JSON (``to_dict`` / ``from_dict``); "" / None / () mean unknown."""

    node: int
    host: str = ""
    boot_id: str = ""
    driver: str | None = None
    cuda_driver: str | None = None
    framework: str = ""
    version: str | None = None
    cuda: str | None = None
    nccl: str | None = None
    gpus: int = 0
    gpu_names: tuple[str, ...] = ()
    net_plugins: tuple[str, ...] = ()
    master_family: str = ""
    route: str = ""
    hostname_loopback: bool | None = None
    #: the node's NCCL_* / GLOO_* variables (less those that only change logging), sorted
    env: tuple[tuple[str, str], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeFacts:
        """From its JSON form; a field of the wrong type is a ValueError naming it."""
        _check_keys(cls, data, "node facts")
        d = dict(data)
        for key in ("gpu_names", "net_plugins"):
            d[key] = tuple(str(x) for x in d.get(key, ()) or ())
        env = d.get("env", ()) or ()
        d["env"] = tuple(sorted((str(k), str(v)) for k, v in (
            env.items() if isinstance(env, Mapping) else map(tuple, env))))
        if not isinstance(d.get("node"), int) or isinstance(d.get("node"), bool):
            raise ValueError(f"node facts: node must be an integer, not {d.get('node')!r}")
        if not isinstance(d.get("gpus", 0), int):
            raise ValueError(f"node facts: gpus must be an integer, not {d.get('gpus')!r}")
        return cls(**d)


@dataclass(frozen=True)
class Visibility:
    """How ``CUDA_VISIBLE_DEVICES`` resolved. ``physical`` lists NVML indices in job order."""

    raw: str | None = None  # the variable as set; None when unset
    physical: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class LinkSummary:
    """Aggregates over every pair of visible GPUs."""

    all_nvlink: bool  # every pair has an NVLink (and there is a pair)
    any_pcie_only: bool  # some pair has no NVLink (or no link fact)
    p2p_unsupported: bool  # some pair without NVLink reports P2P as not usable
    cross_socket: bool  # some pair crosses CPU sockets
    any_nvlink: bool = False  # some pair has an NVLink
    any_switch: bool = False  # some pair without NVLink shares a PCIe switch (PIX / PXB)
    any_host_path: bool = False  # some pair without NVLink crosses a host bridge or CPU


_NO_PEERS: frozenset[int] = frozenset()


@dataclass
class _LinkIndex:
    """Links by pair, NVLink peers by GPU, and answers already computed (one per Facts)."""

    by_pair: dict[tuple[int, int], Link]
    gpu_indices: frozenset[int] = frozenset()
    nvlink_peers: dict[int, frozenset[int]] | None = None
    all_nvlink: dict[tuple[int, ...], bool] = field(default_factory=dict)
    summary: LinkSummary | None = None

    def peers(self) -> dict[int, frozenset[int]]:
        """GPU -> the GPUs it has an NVLink to."""
        if self.nvlink_peers is None:
            peers: dict[int, set[int]] = {}
            for (a, b), ln in self.by_pair.items():
                if ln.nvlinks > 0:
                    peers.setdefault(a, set()).add(b)
                    peers.setdefault(b, set()).add(a)
            self.nvlink_peers = {k: frozenset(v) for k, v in peers.items()}
        return self.nvlink_peers


@dataclass(frozen=True)
class Facts:
    """Everything inspected, as one frozen value."""

    gpus: tuple[Gpu, ...] = ()
    links: tuple[Link, ...] = ()
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # e.g. "13.0"
    nvml_error: str | None = None  # why no GPU facts, when NVML was unusable
    visibility: Visibility = field(default_factory=Visibility)
    host: Host = field(default_factory=Host)
    frameworks: tuple[FrameworkInfo, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # relevant environment variables, sorted
    nvml_notes: tuple[str, ...] = ()  # per-GPU values NVML could not read (they show as unknown)
    #: How every pair of GPUs *not* listed in ``links`` is connected (its ``a``/``b`` are unused):
    #: a uniform fabric (an NVSwitch box, a PCIe tree) held once instead of once per pair, so a
    #: machine of N GPUs costs O(N + exceptions), not O(N^2) (`compact_links`). None: an
    #: unlisted pair has no link fact.
    fabric: Link | None = None
    platform: Platform = field(default_factory=Platform)
    #: a multi-node job's nodes as each described itself (node 0 first), gathered by node 0
    #: through the job's store before any probe and compared by the planner; () outside one.
    #: Not part of the fingerprint (a multi-node decision is never cached).
    nodes: tuple[NodeFacts, ...] = ()

    # ----- lookups -----------------------------------------------------------------------------
    def framework(self, name: str) -> FrameworkInfo:
        for fw in self.frameworks:
            if fw.name == name:
                return fw
        return FrameworkInfo(name=name)

    def link(self, a: int, b: int) -> Link | None:
        """The link between GPUs ``a`` and ``b`` (either order), from an index built once."""
        found = self._index().by_pair.get((a, b) if a < b else (b, a))
        if found is None and self.fabric is not None and a != b:
            known = self._index().gpu_indices
            if a in known and b in known:
                return replace(self.fabric, a=min(a, b), b=max(a, b))
        return found

    def all_nvlink(self, devices: Sequence[int]) -> bool:
        """Whether every pair of these GPUs has at least one NVLink (False for fewer than 2)."""
        if len(devices) < 2:
            return False
        index = self._index()
        key = tuple(devices)
        known = index.all_nvlink.get(key)
        if known is None:
            want = set(key)
            if self.fabric is None:
                n = len(want) - 1
                peers = index.peers()
                known = all(len(peers.get(d, _NO_PEERS) & want) == n for d in want)
            else:  # unlisted pairs ride the fabric; the listed ones are the exceptions
                inside = [ln for (a, b), ln in index.by_pair.items() if a in want and b in want]
                known = (self.fabric.nvlinks > 0 or
                         len(inside) == len(want) * (len(want) - 1) // 2) and \
                    all(ln.nvlinks > 0 for ln in inside)
            index.all_nvlink[key] = known
        return known

    def link_summary(self) -> LinkSummary:
        """Aggregates over every pair of visible GPUs (what the rules' ``links.*`` facts read)."""
        index = self._index()
        if index.summary is None:
            indices = {g.index for g in self.gpus}
            pairs = len(indices) * (len(indices) - 1) // 2
            nvlinked = 0
            p2p_unsupported = cross_socket = switch = host_path = False
            for (a, b), ln in index.by_pair.items():
                if a not in indices or b not in indices:
                    continue
                cross_socket = cross_socket or ln.topology == "system"
                if ln.nvlinks > 0:
                    nvlinked += 1
                    continue
                switch = switch or ln.topology in ("single", "multiple")
                host_path = host_path or ln.topology in ("hostbridge", "node", "system")
                if ln.p2p_read not in ("ok", "unknown"):
                    p2p_unsupported = True
            listed = sum(1 for a, b in index.by_pair if a in indices and b in indices)
            fab = self.fabric
            if fab is not None and listed < pairs:  # the pairs the fabric connects
                if fab.nvlinks > 0:
                    nvlinked += pairs - listed
                else:
                    switch = switch or fab.topology in ("single", "multiple")
                    host_path = host_path or fab.topology in ("hostbridge", "node", "system")
                    p2p_unsupported = p2p_unsupported or fab.p2p_read not in ("ok", "unknown")
                cross_socket = cross_socket or fab.topology == "system"
            index.summary = LinkSummary(
                all_nvlink=pairs > 0 and nvlinked == pairs,
                any_pcie_only=nvlinked < pairs,
                p2p_unsupported=p2p_unsupported,
                cross_socket=cross_socket,
                any_nvlink=nvlinked > 0,
                any_switch=switch,
                any_host_path=host_path,
            )
        return index.summary

    def _index(self) -> _LinkIndex:
        index: _LinkIndex | None = self.__dict__.get("_link_index")
        if index is None:
            # reversed: where a pair is listed twice, the first one wins, as a scan would find it
            by_pair = {((ln.a, ln.b) if ln.a < ln.b else (ln.b, ln.a)): ln
                       for ln in reversed(self.links)}
            index = _LinkIndex(by_pair, frozenset(g.index for g in self.gpus))
            object.__setattr__(self, "_link_index", index)  # a cache, not a field: frozen stays
        return index

    @property
    def env_map(self) -> dict[str, str]:
        return dict(self.env)

    # ----- serialization -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Facts:
        """Build facts from a plain mapping (JSON). Unknown keys are an error, missing are defaults."""
        _check_keys(cls, data, "facts")
        gpus = tuple(_gpu(g) for g in data.get("gpus", ()))
        links = tuple(_make(Link, ln, "link") for ln in data.get("links", ()))
        vis = data.get("visibility")
        visibility = (
            Visibility(
                raw=vis.get("raw"),
                physical=tuple(vis.get("physical", ())),
                notes=tuple(vis.get("notes", ())),
            )
            if vis
            else Visibility(physical=tuple(g.physical_index for g in gpus))
        )
        host = _make(Host, data.get("host", {}), "host")
        fws = tuple(
            _make(FrameworkInfo, {**f, "archs": tuple(f.get("archs", ()))}, "framework")
            for f in data.get("frameworks", ())
        )
        env = data.get("env", ())
        env_pairs = tuple(sorted(env.items() if isinstance(env, Mapping) else map(tuple, env)))
        return cls(
            gpus=gpus,
            links=links,
            driver_version=data.get("driver_version"),
            cuda_driver_version=data.get("cuda_driver_version"),
            nvml_error=data.get("nvml_error"),
            visibility=visibility,
            host=host,
            frameworks=fws,
            env=env_pairs,
            nvml_notes=tuple(str(n) for n in data.get("nvml_notes", ())),
            fabric=_make(Link, data["fabric"], "fabric") if data.get("fabric") else None,
            platform=_platform(data.get("platform", {})),
            nodes=tuple(NodeFacts.from_dict(n) for n in data.get("nodes", ()) or ()),
        )

    def fingerprint(self) -> str:
        """A stable hash of what decides whether a strategy works here (for the decision cache).

        Includes GPUs (UUID, name, CC), links, driver, framework/NCCL versions, host transport facts
        and the relevant environment; excludes import state, which changes every run.
        """
        cached: str | None = self.__dict__.get("_fingerprint")
        if cached is not None:
            return cached
        key = {
            "gpus": [(g.uuid, g.name, g.compute_capability, g.mig_enabled) for g in self.gpus],
            "links": [  # asdict(ln), without its deep copies (a 1,024-GPU machine has 523,776)
                {"a": ln.a, "b": ln.b, "topology": ln.topology, "nvlinks": ln.nvlinks,
                 "p2p_read": ln.p2p_read, "p2p_nvlink": ln.p2p_nvlink} for ln in self.links
            ],
            "driver": self.driver_version,
            "frameworks": [(f.name, f.version, f.cuda, f.nccl) for f in self.frameworks],
            "host": [
                self.host.shm_bytes,
                self.host.container,
                self.host.wsl2,
                self.host.iommu,
                self.host.kernel,
            ],
            "env": [kv for kv in self.env if kv[0] not in _PER_RUN_ENV],
        }
        if self.fabric is not None:  # absent otherwise: fingerprints of listed machines unchanged
            key["fabric"] = [self.fabric.topology, self.fabric.nvlinks, self.fabric.p2p_read,
                             self.fabric.p2p_nvlink]
        # The route to MASTER_ADDR follows a per-run variable (a single-node torchrun sets it to
        # 127.0.0.1, a command-line probe does not) and decides only between nodes, where no
        # cache is used: left out, as MASTER_ADDR is.
        # The boot id changes at every reboot and the address family follows MASTER_ADDR: both
        # left out (they speak only between nodes, where no cache is used).
        platform = replace(self.platform, master_ifname="", master_route="", master_family="",
                           boot_id="")
        if platform != Platform():  # unknown platform facts keep the older fingerprints
            key["platform"] = {k: v for k, v in asdict(platform).items()
                               if k not in _LATER_PLATFORM or v}  # (later fields: only if known)
        blob = json.dumps(key, sort_keys=True, default=list).encode()
        digest = hashlib.sha256(blob).hexdigest()[:16]
        object.__setattr__(self, "_fingerprint", digest)  # a cache, not a field
        return digest


#: Platform fields added after fingerprints were first kept: in the fingerprint only when known,
#: so that the fingerprints of machines without them stay what they were.
_LATER_PLATFORM = frozenset({"fabric_manager", "net_plugins", "master_family", "boot_id"})


def _check_keys(cls: type, data: Mapping[str, Any], what: str) -> None:
    allowed = {f.name for f in fields(cls)}
    unknown = set(data) - allowed
    if unknown:
        raise ValueError(f"unknown {what} field(s): {sorted(unknown)}; allowed: {sorted(allowed)}")


def _make(cls: type, data: Mapping[str, Any], what: str) -> Any:
    _check_keys(cls, data, what)
    return cls(**data)


def _platform(data: Mapping[str, Any]) -> Platform:
    d = dict(data)
    for key in ("rdma_devices", "net_plugins"):
        if key in d:
            d[key] = tuple(str(x) for x in d[key])
    value: Platform = _make(Platform, d, "platform")
    if value.rdma_link_layer not in RDMA_LINK_LAYERS:
        raise ValueError(f"platform.rdma_link_layer must be one of {RDMA_LINK_LAYERS}, not "
                         f"{value.rdma_link_layer!r}")
    return value


def _gpu(data: Mapping[str, Any]) -> Gpu:
    d = dict(data)
    cc = d.get("compute_capability", (0, 0))
    if isinstance(cc, str):
        major, _, minor = cc.partition(".")
        cc = (int(major), int(minor or 0))
    d["compute_capability"] = (int(cc[0]), int(cc[1]))
    return _make(Gpu, d, "gpu")  # type: ignore[no-any-return]


def relevant_env(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The subset of an environment that changes distributed behaviour, sorted."""
    return tuple(
        sorted(
            (k, v)
            for k, v in env.items()
            if k in RELEVANT_ENV_NAMES or k.startswith(RELEVANT_ENV_PREFIXES)
        )
    )


#: Machines with more GPUs than this keep a uniform fabric once (`compact_links`); smaller
#: ones list every pair, as ``doctor`` and their JSON always showed them.
FABRIC_MIN_GPUS = 16


def compact_links(gpus: int, links: tuple[Link, ...]) -> tuple[tuple[Link, ...], Link | None]:
    """``(listed, fabric)`` for the links of ``gpus`` GPUs: where there are more than
    `FABRIC_MIN_GPUS` and every pair is listed once, the most common kind of link becomes
    the fabric and only the pairs that differ stay listed. Otherwise ``(links, None)``."""
    if gpus <= FABRIC_MIN_GPUS or len(links) != gpus * (gpus - 1) // 2:
        return links, None
    kinds = Counter(map(_LINK_KIND, links))
    (topology, nvlinks, p2p_read, p2p_nvlink), _ = kinds.most_common(1)[0]
    fabric = Link(0, 0, topology, nvlinks, p2p_read, p2p_nvlink)
    if len(kinds) == 1:
        return (), fabric
    common = _LINK_KIND(fabric)
    return tuple(ln for ln in links if _LINK_KIND(ln) != common), fabric


_LINK_KIND = attrgetter("topology", "nvlinks", "p2p_read", "p2p_nvlink")
