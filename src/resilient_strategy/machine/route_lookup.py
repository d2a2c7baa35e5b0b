"""The interface this host uses to reach the rendezvous host (``MASTER_ADDR``), read from the
kernel's routing table: a platform fact (``Platform.master_ifname``, shown by ``doctor``) and
what ``nodes/routes.py`` resolves a candidate's ``@route`` variable to on each node.

No framework, no process. `route_interface` is pure (the text of ``/proc/net/route`` and
the interfaces' addresses in, the interface and how it was found out); the readers around it
turn anything unreadable into "unknown". A host name is resolved with a deadline
(`RESOLVE_DEADLINE_S`): a resolver that hangs leaves the route unknown, it never blocks
the decision.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
import threading
from collections.abc import Callable, Mapping

__all__ = ["PROC_NET_ROUTE", "RESOLVE_DEADLINE_S", "address_family", "local_addresses",
           "master_family", "master_host", "resolve_ipv4", "route_address", "route_interface",
           "route_to_master"]

#: The kernel's IPv4 routing table, relative to the file-system root.
PROC_NET_ROUTE = "proc/net/route"
#: How long a host name may take to resolve before the route counts as unknown.
RESOLVE_DEADLINE_S = 2.0
_SIOCGIFADDR = 0x8915
#: /proc/net/route's flag of an unreachable or prohibit route; a blackhole route has no flag of
#: its own there, only no device ("*", as the other two): the kernel drops what goes to it
_RTF_REJECT = 0x0200
#: The rendezvous endpoint torchrun reads from the environment (``--rdzv-endpoint``), used when
#: ``MASTER_ADDR`` is not set (the supervisor of ``resilient-strategy run`` decides before any).
RDZV_ENDPOINT_VAR = "PET_RDZV_ENDPOINT"


def route_interface(
    dest: str, routes: str, local_addresses: Mapping[str, str]
) -> tuple[str | None, str]:
    """The interface this host uses to reach IPv4 address ``dest``, and how it was found. Pure.

    A loopback address: the loopback interface (the whole job is on this host). An address of
    this host: the interface that holds it (the other nodes reach this one there; the kernel
    would say ``lo``, which NCCL could not offer them). Else the longest-prefix match of the
    kernel's main routing table (``routes``: the text of /proc/net/route), lowest metric first.
    """
    try:
        ip = ipaddress.ip_address(dest)
    except ValueError:
        return None, f"{dest!r} is not an IP address"
    if ip.version != 4:
        return None, f"{dest} is IPv6; only IPv4 routes are read"
    if ip.is_loopback:
        lo = next((n for n, a in local_addresses.items()
                   if ipaddress.ip_address(a).is_loopback), "lo")
        return lo, f"{dest} is a loopback address: every node is on this host"
    for name, addr in local_addresses.items():
        if addr == dest:
            return name, f"{dest} is this host's own address on {name}"
    want = struct.unpack("=I", socket.inet_aton(dest))[0]  # /proc/net/route's byte order
    best: tuple[int, int, str, str] | None = None
    for line in routes.splitlines()[1:]:
        f = line.split()
        if len(f) < 8:
            continue
        try:
            dst, flags, metric, mask = int(f[1], 16), int(f[3], 16), int(f[6]), int(f[7], 16)
        except ValueError:
            continue
        if not flags & 0x1 or want & mask != dst:  # RTF_UP
            continue
        bits = bin(mask).count("1")
        if best is None or (bits, -metric) > (best[0], best[1]):
            net = socket.inet_ntoa(struct.pack("=I", dst))
            if f[0] == "*" or flags & _RTF_REJECT:
                best = (bits, -metric, "", f"the kernel route {net}/{bits} rejects {dest}: a "
                        "blackhole, unreachable or prohibit route, no device (/proc/net/route)")
            else:
                best = (bits, -metric, f[0],
                        f"kernel route {net}/{bits} dev {f[0]} (/proc/net/route)")
    if best is None:
        return None, f"no route to {dest} in /proc/net/route"
    return best[2] or None, best[3]


def local_addresses() -> dict[str, str]:
    """Each interface's (first) IPv4 address, read with SIOCGIFADDR; {} where that fails."""
    out: dict[str, str] = {}
    try:
        import fcntl

        names = [n for _, n in socket.if_nameindex()]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for name in names:
                with contextlib.suppress(OSError):
                    packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                         struct.pack("256s", name.encode()[:15]))
                    out[name] = socket.inet_ntoa(packed[20:24])
    except (ImportError, OSError, AttributeError):
        pass
    return out


def resolve_ipv4(host: str, deadline_s: float = RESOLVE_DEADLINE_S) -> tuple[str | None, str]:
    """``host``'s first IPv4 address (an address is returned as is), or None and why. The
    resolver runs in a daemon thread given ``deadline_s``: one that hangs is left behind."""
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(host)), ""
    box: list[tuple[str | None, str]] = []

    def lookup() -> None:
        try:
            box.append((str(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]), ""))
        except (OSError, IndexError, UnicodeError) as exc:
            box.append((None, f"cannot resolve {host}: {exc}"))

    worker = threading.Thread(target=lookup, name="resilient_strategy-resolve", daemon=True)
    worker.start()
    worker.join(deadline_s)
    if not box:
        return None, f"resolving {host} took longer than {deadline_s:g} s"
    return box[0]


def address_family(host: str, deadline_s: float = RESOLVE_DEADLINE_S,
                   lookup: Callable[[str], int] | None = None) -> str:
    """The address family ``host`` resolves to here, "ipv4" or "ipv6" (the first answer of the
    resolver, which is what a connect tries first), or "" unknown. An address is its own
    family; a name is resolved in a daemon thread given ``deadline_s`` (``lookup``: the
    resolver, for tests: a name -> ``socket.AF_INET`` / ``AF_INET6``)."""
    with contextlib.suppress(ValueError):
        return f"ipv{ipaddress.ip_address(host.strip('[]')).version}"
    box: list[int] = []

    def resolve() -> None:
        with contextlib.suppress(OSError, IndexError, UnicodeError):
            box.append(lookup(host) if lookup else
                       int(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]))

    worker = threading.Thread(target=resolve, name="resilient_strategy-family", daemon=True)
    worker.start()
    worker.join(deadline_s)
    families = {int(socket.AF_INET): "ipv4", int(socket.AF_INET6): "ipv6"}
    return families.get(box[0], "") if box else ""


def master_family(env: Mapping[str, str]) -> str:
    """The address family the rendezvous host (`master_host`) resolves to here ("" unknown or
    not set): nodes that disagree cannot all reach it, and gloo pairs fail between them."""
    host, _ = master_host(env)
    return address_family(host) if host else ""


def master_host(env: Mapping[str, str]) -> tuple[str, str]:
    """(the rendezvous host, the variable it came from): ``MASTER_ADDR``, else the host of
    torchrun's ``PET_RDZV_ENDPOINT``; ("", "") when neither is set."""
    host = env.get("MASTER_ADDR", "").strip()
    if host:
        return host, "MASTER_ADDR"
    endpoint = env.get(RDZV_ENDPOINT_VAR, "").strip()
    if endpoint:
        host = endpoint.rpartition(":")[0] if endpoint.count(":") == 1 or endpoint.startswith(
            "[") else endpoint
        return host.strip("[]"), RDZV_ENDPOINT_VAR
    return "", ""


def route_to_master(
    env: Mapping[str, str], root: str = "/",
    addresses: Callable[[], Mapping[str, str]] = local_addresses,
    resolve: Callable[[str], tuple[str | None, str]] = resolve_ipv4,
) -> tuple[str | None, str]:
    """The interface routing to the rendezvous host (`master_host`) here, and how it was
    found (or why not). ``root``, ``addresses`` and
    ``resolve`` let tests describe the machine."""
    host, var = master_host(env)
    if not host:
        return None, "MASTER_ADDR is not set"
    dest, why = resolve(host)
    if dest is None:
        return None, why
    try:
        with open(os.path.join(root, PROC_NET_ROUTE), encoding="utf-8", errors="replace") as f:
            routes = f.read(1 << 20)
    except OSError:
        routes = ""
    iface, how = route_interface(dest, routes, addresses())
    return iface, (how if dest == host else f"{var}={host} is {dest}; {how}")


def route_address(host: str) -> str | None:
    """This host's IPv4 address on the interface that routes to ``host`` (None when unknown).
    What the other nodes can reach this one at: torch's c10d rendezvous otherwise advertises the
    agent's FQDN as the workers' MASTER_ADDR, which may resolve to a loopback or unreachable
    address on the other nodes (pytorch/pytorch#73656; torchrun's ``--local-addr`` sets it)."""
    iface, _ = route_to_master({"MASTER_ADDR": host})
    return local_addresses().get(iface) if iface else None
