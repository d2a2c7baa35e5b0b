"""Host facts that decide NCCL's transports, read from files under ``root`` (testable).

Each reading is a pure ``_parse_*`` function over text, plus a thin reader that turns an
unreadable file into "unknown".
"""

from __future__ import annotations

import os
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


# ----- thin readers ------------------------------------------------------------------------------
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
