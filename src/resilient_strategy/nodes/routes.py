"""The interface that routes to the rendezvous host: read from the kernel's routing table
(:func:`route_interface`), resolved on each node for a candidate whose variable is ``@route``
(:func:`node_values`), and the remedies between nodes as rules (:func:`remedy_rules`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.rules import Rule

if TYPE_CHECKING:
    pass

log = logging.getLogger("resilient_strategy")

#: A candidate's variable with this value means: the interface routing to the rendezvous host,
#: resolved on each node (:func:`node_values`).
ROUTE = "@route"

PROC_NET_ROUTE = Path("/proc/net/route")
_SIOCGIFADDR = 0x8915

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
            best = (bits, -metric, f[0], f"kernel route {net}/{bits} dev {f[0]} (/proc/net/route)")
    if best is None:
        return None, f"no route to {dest} in /proc/net/route"
    return best[2], best[3]


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


def route_to_master(env: Mapping[str, str]) -> tuple[str | None, str]:
    """The interface routing to ``MASTER_ADDR`` here, and how it was found."""
    host = env.get("MASTER_ADDR", "")
    if not host:
        return None, "MASTER_ADDR is not set"
    try:
        dest = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except (OSError, IndexError) as exc:
        return None, f"cannot resolve MASTER_ADDR={host}: {exc}"
    try:
        routes = PROC_NET_ROUTE.read_text(encoding="utf-8")
    except OSError:
        routes = ""
    iface, how = route_interface(str(dest), routes, local_addresses())
    return iface, (how if dest == host else f"MASTER_ADDR={host} is {dest}; {how}")


def route_address(host: str) -> str | None:
    """This host's IPv4 address on the interface that routes to ``host`` (None when unknown).
    What the other nodes can reach this one at: torch's c10d rendezvous otherwise advertises the
    agent's FQDN as the workers' MASTER_ADDR, which may resolve to a loopback or unreachable
    address on the other nodes (pytorch/pytorch#73656; torchrun's ``--local-addr`` sets it)."""
    iface, _ = route_to_master({"MASTER_ADDR": host})
    return local_addresses().get(iface) if iface else None


def node_values(values: Mapping[str, str], env: Mapping[str, str]) -> dict[str, str]:
    """``values`` with :data:`ROUTE` resolved to this node's interface routing to the master
    (dropped, with a warning, when there is none)."""
    out = dict(values)
    for name, value in values.items():
        if value == ROUTE:
            iface, how = route_to_master(env)
            if iface:
                out[name] = iface
            else:
                del out[name]
                log.warning("resilient_strategy: %s not set: %s", name, how)
    return out


#: gloo's interface variable: without it gloo binds to the address the hostname resolves to
#: (127.0.1.1 on Debian's /etc/hosts, 127.0.0.1 in many containers, or an interface the other
#: nodes cannot reach) and the nodes never connect: "Gloo connectFullMesh failed ...
#: remote=[127.0.0.1]" (pytorch/gloo#70, aws-samples/aws-do-eks#69; seen in tests/testbed.py).
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


def between_nodes(backend: str, values: Mapping[str, str], env: Mapping[str, str]) -> dict[str, str]:
    """The variables a candidate spanning nodes needs on this node: its own ``values``, plus, for
    gloo, :data:`GLOO_IFNAME` on the interface that routes to the master unless the user set it;
    :data:`ROUTE` resolved (:func:`node_values`)."""
    out = dict(values)
    if backend == "gloo" and GLOO_IFNAME not in env:
        out.setdefault(GLOO_IFNAME, ROUTE)
    return node_values(out, env)


def remedy_rules() -> tuple[Rule, ...]:
    """NCCL remedies between nodes, tried (and measured) after plain NCCL fails between them."""
    src = ("NCCL environment variables (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html);"
           " ray-project/ray#30333 (a guessed NCCL_SOCKET_IFNAME default broke other clusters)")
    return (
        Rule(id="multinode-socket-ifname", when=(), effect="remedy", framework="torch",
             message="NCCL's bootstrap and sockets on the interface that routes to the rendezvous "
             "host: NCCL's own pick may not reach the other nodes and then hangs",
             source=src, env=(("NCCL_SOCKET_IFNAME", ROUTE),), origin="multinode"),
        Rule(id="multinode-socket-transport", when=(), effect="remedy", framework="torch",
             message="NCCL over TCP sockets on the routed interface, InfiniBand and network "
             "plugins off: a misconfigured InfiniBand or EFA fabric fails or hangs NCCL",
             source=src, origin="multinode",
             env=(("NCCL_IB_DISABLE", "1"), ("NCCL_NET", "Socket"),
                  ("NCCL_SOCKET_IFNAME", ROUTE))),
    )
