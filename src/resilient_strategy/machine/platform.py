"""Platform facts around the GPUs, read from files under ``root`` (testable): the NVSwitch
fabric, a hypervisor, the RDMA ports' link layer, whether the hostname resolves to loopback, the
interface that routes to ``MASTER_ADDR`` and the address family it resolves to (`routes`,
where ``MASTER_ADDR`` or torchrun's rendezvous endpoint is set), the NCCL network plugins
installed (``libnccl-net*.so``), and the kernel's boot id (one per host, shared by its
containers: what tells pods of one host apart from nodes).

Each reading is a pure ``parse_*`` function over text, plus a thin reader that turns an
unreadable file into "unknown" (``None`` / ``""``). No process, no framework; the one name
lookup (a ``MASTER_ADDR`` that is a host name) has a deadline (`routes.RESOLVE_DEADLINE_S`).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterable, Mapping, Sequence

from ..core.values.facts import Platform
from .route_lookup import master_family, master_host, route_to_master

#: DMI system vendors / product names of hypervisors, as words.
_HYPERVISORS = (
    ("qemu", "kvm"), ("kvm", "kvm"), ("vmware", "vmware"), ("microsoft corporation", "hyperv"),
    ("virtualbox", "virtualbox"), ("innotek", "virtualbox"), ("xen", "xen"),
    ("amazon ec2", "kvm"), ("google compute engine", "kvm"), ("openstack", "kvm"),
)
#: How much of /proc/cpuinfo is read: the first processor's block has the flags.
_CPUINFO_BYTES = 64 << 10


def detect_platform(env: Mapping[str, str], root: str = "/") -> Platform:
    """Read the platform facts; ``root`` lets tests point at a fake file tree. ``env`` names the
    rendezvous host (``MASTER_ADDR``) whose route is read."""
    has_master = bool(master_host(env)[0])
    iface, how = route_to_master(env, root) if has_master else (None, "")
    devices = _list(root, "sys/class/infiniband") or []
    ports = {d: [(_read(root, f"sys/class/infiniband/{d}/ports/{p}/link_layer") or "",
                  _read(root, f"sys/class/infiniband/{d}/ports/{p}/state") or "")
                 for p in _list(root, f"sys/class/infiniband/{d}/ports") or ()]
             for d in devices}
    layer, active = parse_rdma(ports)
    return Platform(
        nvswitch=parse_nvswitch(_list(root, "proc/driver/nvidia-nvswitch/devices"),
                                _exists(root, "proc/driver/nvidia")),
        hypervisor=parse_hypervisor(
            _read(root, "proc/cpuinfo", _CPUINFO_BYTES),
            [_read(root, f"sys/devices/virtual/dmi/id/{f}") for f in ("sys_vendor",
                                                                      "product_name")],
            _read(root, "sys/hypervisor/type")),
        rdma_link_layer=layer,
        rdma_devices=active,
        hostname_loopback=parse_hosts(_read(root, "etc/hosts"), _hostname()),
        master_ifname=iface or "",
        master_route=how,
        fabric_manager=parse_fabric_manager(_lines(root, "var/lib/dpkg/status", _DPKG_BYTES)),
        net_plugins=parse_net_plugins(
            {d: _list(root, d.lstrip("/")) or [] for d in plugin_dirs(env)}),
        master_family=master_family(env) if has_master else "",
        boot_id=(_read(root, "proc/sys/kernel/random/boot_id", 64) or "").strip(),
    )


def parse_nvswitch(devices: Sequence[str] | None, nvidia_driver: bool) -> bool | None:
    """True when the NVSwitch driver lists devices; False when the NVIDIA driver is loaded and
    it lists none; None (unknown) without the driver."""
    if devices:
        return True
    return False if nvidia_driver else None


def parse_hypervisor(cpuinfo: str | None, dmi: Sequence[str | None],
                     xen_type: str | None) -> str:
    """The hypervisor this runs under ("kvm", "vmware", "hyperv", "xen", ..., "other"), or ""
    when the CPU does not report one."""
    if xen_type and xen_type.strip():
        return "xen"
    if cpuinfo is None or " hypervisor" not in cpuinfo:
        return ""
    words = " ".join((t or "").strip().lower() for t in dmi)
    return next((name for hint, name in _HYPERVISORS if hint in words), "other")


def parse_rdma(ports: Mapping[str, Sequence[tuple[str, str]]]) -> tuple[str, tuple[str, ...]]:
    """(link layer of the active ports, the HCAs with an active port). The layer is
    "infiniband" when any active port is InfiniBand, else "ethernet" (RoCE) when any is, else
    "" (no active RDMA port)."""
    layers: set[str] = set()
    active: list[str] = []
    for device, states in sorted(ports.items()):
        for layer, state in states:
            if "ACTIVE" in state.upper():
                layers.add(layer.strip().lower())
                if device not in active:
                    active.append(device)
    layer = "infiniband" if "infiniband" in layers else "ethernet" if "ethernet" in layers else ""
    return layer, tuple(active)


def parse_hosts(hosts: str | None, hostname: str) -> bool | None:
    """Whether ``/etc/hosts`` maps the hostname to a loopback address (127.x, ::1): gloo and
    NCCL then advertise an address the other nodes cannot reach. None when it does not name it."""
    if hosts is None or not hostname:
        return None
    short = hostname.split(".")[0]
    for line in hosts.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2 and (hostname in fields[1:] or short in fields[1:]):
            return fields[0].startswith("127.") or fields[0] == "::1"
    return None


#: How much of dpkg's status file is read for the fabric manager's package (it lists every
#: installed package: a few MB on a full image).
_DPKG_BYTES = 32 << 20
_FM_PACKAGE = re.compile(r"^Package:\s*nvidia-fabricmanager(-\d+)?\s*$")


def parse_fabric_manager(lines: Iterable[str] | None) -> str:
    """The installed nvidia-fabricmanager package's version from dpkg's status lines
    ("535.183.01" from "Version: 535.183.01-1"), or "" where none is installed or unknown."""
    if lines is None:
        return ""
    in_fm = installed = False
    version = ""
    for line in lines:
        line = line.rstrip("\n")
        if line.startswith("Package:"):
            if in_fm and installed and version:
                return version
            in_fm, installed, version = bool(_FM_PACKAGE.match(line)), False, ""
        elif in_fm and line.startswith("Status:"):
            installed = line.split()[-1:] == ["installed"]
        elif in_fm and line.startswith("Version:"):
            raw = line.split(":", 1)[1].strip()
            raw = raw.split(":", 1)[1] if ":" in raw else raw  # an epoch
            version = raw.rsplit("-", 1)[0] if "-" in raw else raw
    return version if in_fm and installed else ""


#: Where NCCL network plugins are installed besides ``LD_LIBRARY_PATH``: the system's library
#: directories, and the places the AWS OFI and HPC-X (SHARP) plugins install to.
PLUGIN_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
               "/usr/lib", "/usr/local/lib", "/opt/amazon/ofi-nccl/lib",
               "/opt/amazon/ofi-nccl/lib64", "/opt/aws-ofi-nccl/lib",
               "/opt/hpcx/nccl_rdma_sharp_plugin/lib")
#: At most this many ``LD_LIBRARY_PATH`` entries are listed.
_MAX_LIBRARY_DIRS = 32


def plugin_dirs(env: Mapping[str, str]) -> tuple[str, ...]:
    """The directories NCCL's ``dlopen`` of a network plugin searches, as far as we know them:
    ``LD_LIBRARY_PATH`` first, then `PLUGIN_DIRS`."""
    extra = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d.startswith("/")]
    return tuple(dict.fromkeys([*extra[:_MAX_LIBRARY_DIRS], *PLUGIN_DIRS]))


def parse_net_plugins(listings: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    """The NCCL network plugins found: the ``libnccl-net*.so*`` files of ``listings``
    (directory -> its file names), sorted. (``NCCL_NET_PLUGIN``, which names one, is compared
    between the nodes as a variable.)"""
    return tuple(sorted({n for names in listings.values() for n in names
                         if n.startswith("libnccl-net") and ".so" in n}))


# ----- thin readers ------------------------------------------------------------------------------
def _lines(root: str, rel: str, limit: int) -> list[str] | None:
    """The lines of a file, at most ``limit`` bytes of it; None where it cannot be read."""
    try:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            return f.read(limit).splitlines()
    except OSError:
        return None


def _read(root: str, rel: str, limit: int = 4096) -> str | None:
    try:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            return f.read(limit)
    except OSError:
        return None


def _list(root: str, rel: str) -> list[str] | None:
    try:
        return sorted(os.listdir(os.path.join(root, rel)))
    except OSError:
        return None


def _exists(root: str, rel: str) -> bool:
    return os.path.exists(os.path.join(root, rel))


def _hostname() -> str:
    try:
        return socket.gethostname()
    except OSError:
        return ""
