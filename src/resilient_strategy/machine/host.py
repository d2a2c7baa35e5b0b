"""Host facts that decide NCCL's transports, read from files under ``root`` (testable).

Each reading is a pure ``_parse_*`` function over text, plus a thin reader that turns an
unreadable file into "unknown".
"""

from __future__ import annotations

import os
import platform as _platform
import re
import sys
from collections.abc import Mapping, Sequence

from ..core.values.facts import Host

_SAGEMAKER_ENV = ("SM_HOSTS", "SM_CURRENT_HOST", "SM_TRAINING_ENV", "SM_MODEL_DIR")
#: Container runtimes as named in a cgroup path (cgroup v1 /proc/1/cgroup).
_CGROUP_HINTS = (
    ("kubepods", "kubernetes"),
    ("libpod", "podman"),
    ("docker", "docker"),
    ("containerd", "containerd"),
    ("lxc", "lxc"),
)
#: ... and in the source of the bind mounts a runtime puts on /etc/hostname etc. (cgroup v2).
_MOUNT_HINTS = (
    ("/kubelet/pods/", "kubernetes"),
    ("/containers/storage/overlay-containers/", "podman"),
    ("/docker/containers/", "docker"),
    ("/containerd/", "containerd"),
)
_RUNTIME_MOUNTS = ("/etc/hostname", "/etc/hosts", "/etc/resolv.conf")


def detect_host(env: Mapping[str, str], root: str = "/") -> Host:
    """Read the host facts; ``root`` lets tests point at a fake file tree."""
    ib = _list(root, "sys/class/infiniband")
    numa = parse_numa(_numa_nodes(root))
    dmi = [_read(root, f"sys/devices/virtual/dmi/id/{f}") for f in ("sys_vendor", "board_vendor")]
    return Host(
        shm_bytes=_shm_bytes(root),
        container=parse_container(
            env,
            dockerenv=_exists(root, ".dockerenv"),
            containerenv=_exists(root, "run/.containerenv"),
            cgroup=_read(root, "proc/1/cgroup"),
            mountinfo=_read(root, "proc/self/mountinfo"),
        ),
        wsl2=parse_wsl(_read(root, "proc/sys/kernel/osrelease")),
        sagemaker=_exists(root, "opt/ml/input/config/resourceconfig.json")
        or parse_sagemaker_env(env),
        aws=any(parse_aws_vendor(t) for t in dmi),
        efa=parse_efa(ib or ()),
        infiniband=bool(ib),
        iommu=parse_iommu(
            _list(root, "sys/class/iommu"), _read(root, "proc/cmdline"), _iommu_group_types(root)
        ),
        kernel=(_read(root, "proc/sys/kernel/osrelease") or "").strip(),
        cpu_count=_cpu_count(),
        platform=sys.platform,
        memory_available_bytes=parse_meminfo(_read(root, "proc/meminfo")),
        machine=_platform.machine(),
        numa_nodes=numa[0],
        numa_memory_only=numa[1],
        amd_gpus=parse_kfd_nodes(_kfd_properties(root)),
        cuda_compat=parse_cuda_compat(_compat_libs(root)),
        port_range=parse_port_range(_read(root, "proc/sys/net/ipv4/ip_local_port_range")),
        master_port_by=parse_master_port_by(
            env, (_read(root, f"proc/{os.getppid()}/cmdline") or "").split("\0")),
    )


# ----- pure parsers ------------------------------------------------------------------------------
def parse_container(
    env: Mapping[str, str],
    *,
    dockerenv: bool,
    containerenv: bool,
    cgroup: str | None,
    mountinfo: str | None,
) -> str:
    """The container runtime this process runs in, "" when none is seen."""
    if "KUBERNETES_SERVICE_HOST" in env:
        return "kubernetes"
    seen = parse_cgroup(cgroup or "") or parse_mountinfo(mountinfo or "")
    if seen == "kubernetes":
        return seen
    if containerenv:
        return "podman"
    if dockerenv:
        return "docker"
    return seen


def parse_cgroup(text: str) -> str:
    """Runtime named by /proc/1/cgroup lines ("12:cpu:/docker/<id>"); "" on cgroup v2 ("0::/")."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        for hint, runtime in _CGROUP_HINTS:
            if hint in path:
                return runtime
    return ""


def parse_mountinfo(text: str) -> str:
    """Runtime named by the source of the /etc/hostname-like bind mounts in /proc/self/mountinfo.

    Only those mounts count: a host running containers lists their overlay mounts too.
    """
    for line in text.splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4] in _RUNTIME_MOUNTS:
            for hint, runtime in _MOUNT_HINTS:
                if hint in fields[3]:
                    return runtime
    return ""


def parse_wsl(osrelease: str | None) -> bool:
    """WSL2 kernels are named like "5.15.153.1-microsoft-standard-WSL2"."""
    return "microsoft" in (osrelease or "").lower()


def parse_sagemaker_env(env: Mapping[str, str]) -> bool:
    return any(k in env for k in _SAGEMAKER_ENV) or any(k.startswith("SAGEMAKER_") for k in env)


def parse_aws_vendor(text: str | None) -> bool:
    return "amazon" in (text or "").lower()


def parse_efa(devices: Sequence[str]) -> bool:
    """EFA devices appear in /sys/class/infiniband as efa_0 / rdmap<...> (AWS EFA driver)."""
    return any(d.startswith(("efa", "rdmap")) for d in devices)


def parse_iommu(
    devices: Sequence[str] | None,
    cmdline: str | None,
    group_types: Sequence[str] | None = None,
) -> str:
    """"on" when the IOMMU translates DMA (P2P then detours through the root complex), else
    "off"; passthrough counts as off. "unknown" when nothing could be read.

    The kernel says what each IOMMU group's default domain does in
    /sys/kernel/iommu_groups/<n>/type: "identity" is passthrough (DMA addresses are physical:
    P2P is not redirected), "DMA" / "DMA-FQ" translate. Those are read first: an IOMMU that is
    present (/sys/class/iommu has entries) is often in passthrough, by the kernel's default
    (CONFIG_IOMMU_DEFAULT_PASSTHROUGH) or by ``iommu=pt``. Groups of other types ("unmanaged":
    handed to VFIO; "blocked") say nothing about the host's own devices. Without group types,
    the kernel command line decides, then whether an IOMMU is present at all.

    See "PCI Access Control Services" in NCCL's troubleshooting guide:
    https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting.html and the
    kernel's sysfs-kernel-iommu_groups ABI:
    https://www.kernel.org/doc/Documentation/ABI/testing/sysfs-kernel-iommu_groups
    """
    kinds = {t.strip() for t in group_types or ()}
    if kinds & {"DMA", "DMA-FQ"}:
        return "on"
    if "identity" in kinds:
        return "off"
    args = set((cmdline or "").split())
    if args & {"iommu=pt", "iommu.passthrough=1", "iommu=off", "intel_iommu=off", "amd_iommu=off"}:
        return "off"
    if devices or args & {"intel_iommu=on", "amd_iommu=on", "amd_iommu=force_isolation"}:
        return "on"
    return "unknown" if devices is None and cmdline is None else "off"


def parse_numa(nodes: Mapping[str, tuple[str | None, str | None]] | None
               ) -> tuple[int | None, int | None]:
    """``(nodes with memory, of them the ones without a CPU)`` from each NUMA node's
    ``(cpulist, meminfo)`` (``/sys/devices/system/node/nodeN/``); ``(None, None)`` unknown.
    A node whose ``MemTotal`` is 0 holds no memory and is not counted."""
    if not nodes:
        return None, None
    with_memory = memory_only = 0
    for cpulist, meminfo in nodes.values():
        m = re.search(r"MemTotal:\s+(\d+)", meminfo or "")
        if meminfo is not None and (m is None or int(m.group(1)) == 0):
            continue
        with_memory += 1
        if cpulist is not None and not cpulist.strip():
            memory_only += 1
    return with_memory, memory_only


def parse_numa_node(text: str | None) -> int | None:
    """A PCI device's ``numa_node`` file: the node, or None (-1: the kernel knows none)."""
    try:
        value = int((text or "").strip())
    except ValueError:
        return None
    return value if value >= 0 else None


def parse_kfd_nodes(properties: Sequence[str] | None) -> int | None:
    """AMD GPUs from the ROCm kernel driver's topology (one ``properties`` text per
    ``/sys/class/kfd/kfd/topology/nodes/N``): the nodes with SIMDs are GPUs, the others CPUs.
    None: no kfd topology (no ROCm driver here)."""
    if properties is None:
        return None
    count = 0
    for text in properties:
        m = re.search(r"^simd_count\s+(\d+)", text, re.MULTILINE)
        if m and int(m.group(1)) > 0:
            count += 1
    return count


def parse_cuda_compat(names: Sequence[str]) -> str:
    """The version of the newest CUDA forward-compatibility driver among library file names
    (``libcuda.so.550.54.15`` -> "550.54.15"); "" when none."""
    found = sorted({m.group(1) for n in names
                    if (m := re.fullmatch(r"libcuda\.so\.(\d+\.\d+(?:\.\d+)?)", n))},
                   key=lambda v: tuple(int(x) for x in v.split(".")))
    return found[-1] if found else ""


def parse_port_range(text: str | None) -> str:
    """``net.ipv4.ip_local_port_range`` ("32768\t60999") as "32768-60999"; "" unknown."""
    parts = (text or "").split()
    if len(parts) == 2 and all(p.isdigit() for p in parts):
        return f"{int(parts[0])}-{int(parts[1])}"
    return ""


#: The flags torch's launchers (torchrun, `resilient-strategy run`) take the port of the
#: static rendezvous from (torch/distributed/run.py; ``PET_MASTER_PORT`` is the same flag set
#: in the environment).
_MASTER_PORT_FLAGS = ("--master-port", "--master_port")


def parse_master_port_by(env: Mapping[str, str], launcher_argv: Sequence[str]) -> str:
    """Who chose this process's ``MASTER_PORT`` (`Host.master_port_by`): "" when there is none;
    "user" when no launcher's store holds it (``TORCHELASTIC_USE_AGENT_STORE`` is not "True":
    the job's rank 0 binds it itself) or when it is the port the launcher was given
    (``--master-port N`` in ``launcher_argv``, the parent's command line, or
    ``PET_MASTER_PORT``); "launcher" otherwise: torch >= 2.12's torchrun without
    ``--master-port`` (and ``--standalone``, and a c10d endpoint) binds a port the kernel
    picks, held by its store before any worker starts. Pure."""
    port = (env.get("MASTER_PORT") or "").strip()
    if not port:
        return ""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return "user"
    given = {(env.get("PET_MASTER_PORT") or "").strip()}
    args = list(launcher_argv)
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in _MASTER_PORT_FLAGS:
            given.add(value.strip() if eq else (args[i + 1].strip() if i + 1 < len(args)
                                                else ""))
    return "user" if port in given else "launcher"


# ----- thin readers ------------------------------------------------------------------------------
def _numa_nodes(root: str) -> dict[str, tuple[str | None, str | None]] | None:
    base = "sys/devices/system/node"
    names = [n for n in _list(root, base) or () if re.fullmatch(r"node\d+", n)]
    return {n: (_read(root, f"{base}/{n}/cpulist"), _read(root, f"{base}/{n}/meminfo"))
            for n in names} or None


def _kfd_properties(root: str) -> list[str] | None:
    base = "sys/class/kfd/kfd/topology/nodes"
    nodes = _list(root, base)
    if nodes is None:
        return None
    return [t for n in nodes if (t := _read(root, f"{base}/{n}/properties")) is not None]


#: Where CUDA images install the forward-compatibility driver (the cuda-compat package).
_COMPAT_DIRS = ("usr/local/cuda/compat",)


def _compat_libs(root: str) -> list[str]:
    dirs = [*_COMPAT_DIRS, *(f"usr/local/{d}/compat" for d in _list(root, "usr/local") or ()
                             if re.fullmatch(r"cuda-\d+\.\d+", d))]
    return [n for d in dirs for n in _list(root, d) or ()]


def gpu_numa_node(root: str, pci_bus_id: str) -> int | None:
    """The NUMA node of the GPU at NVML's ``pci_bus_id`` ("00000000:3B:00.0"), from sysfs
    ("0000:3b:00.0"); None unknown."""
    domain, _, rest = pci_bus_id.strip().partition(":")
    if not rest or not domain:
        return None
    bdf = f"{domain[-4:]}:{rest}".lower()
    if not re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", bdf):
        return None
    return parse_numa_node(_read(root, f"sys/bus/pci/devices/{bdf}/numa_node"))


def parse_meminfo(text: str | None) -> int | None:
    """MemAvailable of /proc/meminfo, in bytes (the kernel's estimate of what new processes can
    use without swapping); None when absent."""
    for line in (text or "").splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if name == "MemAvailable" and parts and parts[0].isdigit():
            return int(parts[0]) * 1024 if parts[1:] == ["kB"] else int(parts[0])
    return None


def available_memory(root: str = "/") -> int | None:
    """This machine's MemAvailable now, in bytes (None where /proc/meminfo does not say): what
    an asynchronous checkpoint's host copy of the training state is weighed against."""
    return parse_meminfo(_read(root, "proc/meminfo"))


def _path(root: str, rel: str) -> str:
    return os.path.join(root, rel)


def _read(root: str, rel: str) -> str | None:
    try:
        with open(_path(root, rel), encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _list(root: str, rel: str) -> list[str] | None:
    try:
        return sorted(os.listdir(_path(root, rel)))
    except OSError:
        return None


def _exists(root: str, rel: str) -> bool:
    return os.path.exists(_path(root, rel))


def _iommu_group_types(root: str) -> list[str] | None:
    """The ``type`` of every IOMMU group that has one; None when there are none to read."""
    groups = _list(root, "sys/kernel/iommu_groups")
    types = [_read(root, f"sys/kernel/iommu_groups/{g}/type") for g in groups or ()]
    found = [t.strip() for t in types if t and t.strip()]
    return found or None


def _shm_bytes(root: str) -> int | None:
    try:
        st = os.statvfs(_path(root, "dev/shm"))
    except (OSError, AttributeError):  # AttributeError: no statvfs on Windows
        return None
    return st.f_blocks * st.f_frsize


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the CPUs this process may use (cgroups, taskset)
    except (AttributeError, OSError):
        return os.cpu_count() or 1
