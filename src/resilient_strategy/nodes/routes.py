"""The interface that routes to the rendezvous host, resolved on each node for a candidate whose
variable is ``@route`` (`node_values`), and the remedies between nodes as rules
(`remedy_rules`). The lookup itself (the kernel's routing table, `route_interface`)
is a platform fact and lives below, in `resilient_strategy.machine.route_lookup`; its names are
re-exported here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ..core.knowledge.rules import Rule
from ..machine.route_lookup import (
    PROC_NET_ROUTE,
    local_addresses,
    route_address,
    route_interface,
    route_to_master,
)

__all__ = ["GLOO_IFNAME", "PROC_NET_ROUTE", "ROUTE", "between_nodes", "local_addresses",
           "node_values", "remedy_rules", "route_address", "route_interface", "route_to_master"]

log = logging.getLogger("resilient_strategy")

#: A candidate's variable with this value means: the interface routing to the rendezvous host,
#: resolved on each node (`node_values`).
ROUTE = "@route"


def node_values(values: Mapping[str, str], env: Mapping[str, str],
                route: tuple[str | None, str] | None = None) -> dict[str, str]:
    """``values`` with `ROUTE` resolved to this node's interface routing to the master
    (dropped, with a warning, when there is none). ``route``: the interface and how it was found,
    when already known (a described machine: never this host's routing table)."""
    out = dict(values)
    for name, value in values.items():
        if value == ROUTE:
            iface, how = route if route is not None else route_to_master(env)
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


def between_nodes(backend: str, values: Mapping[str, str], env: Mapping[str, str],
                  route: tuple[str | None, str] | None = None) -> dict[str, str]:
    """The variables a candidate spanning nodes needs on this node: its own ``values``, plus, for
    gloo, `GLOO_IFNAME` on the interface that routes to the master unless the user set it;
    `ROUTE` resolved (`node_values`, ``route`` as there)."""
    out = dict(values)
    if backend == "gloo" and GLOO_IFNAME not in env:
        out.setdefault(GLOO_IFNAME, ROUTE)
    return node_values(out, env, route)


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
