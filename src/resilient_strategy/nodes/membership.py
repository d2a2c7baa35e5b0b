"""Who is in the next attempt of a multi-node ``run``: the membership round before each agreement.

Before every launch attempt the nodes' supervisors meet in the job's store (the one node 0
hosts, under ``<job prefix>members/``): every node writes ``join/<node>``; node 0 waits for the
nodes of the last attempt (a node whose verdict on that attempt never came, or that said it was
cut off, was already waited for a heartbeat window: it gets a short grace; every other one the
join window), takes whoever joined,
and publishes ``members``: the nodes of this attempt, who left (and how it was seen) and who
joined. Every node reads it: one that is not in it was dropped and stops (75); the others agree
on the decision for the nodes present and start torch elastic's rendezvous for that many.

Nodes are named by their ``--node-rank`` (their identity, the same in every attempt); inside an
attempt they are numbered by their place among the members (``GROUP_RANK``), node 0 first.

`gather` (node 0) and `await_members` (the others) wait on the store;
`members_of` (pure) says who is in from who joined.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import MultiNodeError, NodeLostError
from .store import Channel

#: How often node 0 looks for the nodes still to join.
JOIN_POLL_S = 0.05
#: How long node 0 waits for a node known gone (its verdict on the last attempt never came,
#: after the heartbeat window): a grace for a record that crossed the round, not another window.
GONE_GRACE_S = 2.0

#: How a node's leaving was seen (the ``how`` of a `Change`).
NO_VERDICT = "no_verdict"  # its verdict on the last attempt never came: it vanished
CUT_OFF = "cut_off"  # it said it could not reach the store (or never joined after saying so)
NOT_JOINED = "not_joined"  # it gave a verdict, then did not join the relaunch in the window
HOWS = frozenset({NO_VERDICT, CUT_OFF, NOT_JOINED})
#: The most nodes a membership record may name (far above any job's).
_MAX_NODE = 1 << 16


def _node(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < _MAX_NODE:
        raise ValueError(f"{v!r} is not a node")
    return v


@dataclass(frozen=True)
class Change:
    """One membership change, as node 0 published it: the nodes of ``attempt``, who left since
    the last attempt and how it was seen (`NO_VERDICT`, `CUT_OFF`,
    `NOT_JOINED`), who joined, and when (wall time, node 0's clock)."""

    attempt: int
    members: tuple[int, ...]
    left: tuple[tuple[int, str], ...] = ()
    joined: tuple[int, ...] = ()
    at: float = 0.0
    seen_s: Mapping[int, float] = field(default_factory=dict)  # node -> waited for it, seconds

    @property
    def changed(self) -> bool:
        return bool(self.left or self.joined)

    def to_dict(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "members": list(self.members),
                "left": [{"node": n, "how": h, "waited_s": round(self.seen_s.get(n, 0.0), 3)}
                         for n, h in self.left],
                "joined": list(self.joined), "at": self.at}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Change:
        """Raises `MultiNodeError` for a record that is not what `to_dict` writes: node 0
        among the members, every node once, no member that left, a known ``how``."""
        try:
            members = tuple(_node(n) for n in d["members"])
            left = tuple((_node(x["node"]), str(x["how"])) for x in d.get("left", []))
            seen = {_node(x["node"]): float(x.get("waited_s", 0.0)) for x in d.get("left", [])}
            joined = tuple(_node(n) for n in d.get("joined", []))
            attempt, at = d["attempt"], float(d.get("at", 0.0))
            if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
                raise ValueError(f"attempt {attempt!r}")
            gone = {n for n, _ in left}
            if (not members or members[0] != 0 or list(members) != sorted(set(members))
                    or gone & set(members) or len(gone) != len(left)
                    or not set(joined) <= set(members)):
                raise ValueError("its nodes are not node 0 and others, each once")
            if any(h not in HOWS for _, h in left):
                raise ValueError("a node left in no known way")
            if not all(math.isfinite(v) and v >= 0 for v in (at, *seen.values())):
                raise ValueError("a time that is no time")
            return cls(attempt, members, left, joined, at, seen)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MultiNodeError(f"unreadable membership record from node 0: {exc}") from exc

    def line(self) -> str:
        """The change in one line (empty when nothing changed)."""
        parts = [f"node {n} left ({h.replace('_', ' ')})" for n, h in self.left]
        parts += [f"node {n} joined" for n in self.joined]
        if not parts:
            return ""
        return (f"attempt {self.attempt + 1}: " + ", ".join(parts) + f"; the job goes on with "
                f"node(s) {', '.join(map(str, self.members))}")


def members_of(attempt: int, before: Sequence[int], joined: Collection[int],
               gone: Mapping[int, str], max_nodes: int) -> Change:
    """The nodes of ``attempt`` (pure): node 0 and every node that joined, at most
    ``max_nodes`` (the lowest first); who of ``before`` (the last attempt's nodes) left, and how
    (``gone``: what was known of it before the round, else `NOT_JOINED`); who is new."""
    present = sorted({0, *(n for n in joined if 0 <= n < max_nodes)})[:max_nodes]
    left = tuple((n, gone.get(n, NOT_JOINED)) for n in sorted(before) if n not in present)
    new = tuple(n for n in present if n not in before) if attempt > 0 else ()
    return Change(attempt, tuple(present), left, new)


#: How long a node that comes back waits for the running job to take it in (node 0 relaunches
#: at once when it sees it; the wait ends early when node 0's store goes, with the job).
REJOIN_WAIT_S = 600.0


def publish_current(store: Any, base: str, change: Change) -> None:
    """Node 0: the membership of the attempt now running, at the job's own key (``base``):
    where a node that comes back reads which attempt to join."""
    Channel(store, base).put("current", change.to_dict())


def read_current(store: Any, base: str) -> Change | None:
    """The membership of the attempt now running (None: the job has not begun one, or the
    record there was refused: logged once, naming the key)."""
    return Channel(store, base).peek_as("current", Change.from_dict)


def waiting(store: Any, prefix: str, present: Collection[int], max_nodes: int
            ) -> tuple[int, ...]:
    """The nodes not in ``present`` that asked to join the attempt whose round is at
    ``prefix``: node 0 stops the running attempt for them."""
    return tuple(k for k in range(max_nodes)
                 if k not in present and store.check([prefix + f"join/{k}"]))


def join(channel: Channel, node: int) -> None:
    """This node asks to be in the attempt (every node, node 0 included)."""
    channel.put(f"join/{node}", {"node": node, "at": time.time()})


def gather(channel: Channel, attempt: int, before: Sequence[int], gone: Mapping[int, str],
           window_s: float, max_nodes: int, clock: Callable[[], float] = time.monotonic,
           quick_s: float = GONE_GRACE_S) -> Change:
    """Node 0: wait for the nodes of the last attempt to join (those in ``gone`` for
    ``quick_s``, the others for ``window_s``), take every node that joined, and publish the
    membership of ``attempt``. Returns it."""
    start = clock()
    wait = {n: (min(quick_s, window_s) if n in gone else window_s) for n in before if n != 0}
    joined: set[int] = {0}
    seen_s: dict[int, float] = {}
    keys = {n: channel.prefix + f"join/{n}" for n in range(max_nodes)}
    while True:
        now = clock()
        for n, key in keys.items():
            if n not in joined and channel.store.check([key]):
                joined.add(n)
        pending = [n for n, w in wait.items() if n not in joined and now - start < w]
        if not pending:
            break
        time.sleep(JOIN_POLL_S)
    for n in wait:
        if n not in joined:
            seen_s[n] = wait[n]
    change = members_of(attempt, before, joined, gone, max_nodes)
    change = Change(change.attempt, change.members, change.left, change.joined, time.time(),
                    seen_s)
    channel.put("members", change.to_dict())
    return change


def await_members(channel: Channel, node: int, timeout_s: float, *, attempt: int | None = None,
                  confirm_s: float = 0.0) -> Change:
    """Every other node: node 0's membership of this attempt; `NodeLostError` naming
    this node when it is not in it (it was dropped: it stops), or when none comes in time.

    ``attempt``: the attempt this round is for (a record of another is refused, logged once,
    and waited past). ``confirm_s``: a record that drops this node is final only once it is
    still there ``confirm_s`` after the wait began (node 0's window: a record written before
    node 0's, by a process outside the job, is replaced by node 0's own when it publishes)."""
    start = time.monotonic()

    def read(d: dict[str, Any]) -> Change:
        got = Change.from_dict(d)
        if attempt is not None and got.attempt != attempt:
            raise MultiNodeError(f"a membership record of attempt {got.attempt + 1}, not "
                                 f"{attempt + 1}")
        return got

    got = channel.take_as("members", read, timeout_s,
                          "node 0 published no membership for this attempt", who=None)
    while node not in got.members and (left := start + confirm_s - time.monotonic()) > 0:
        time.sleep(min(JOIN_POLL_S * 4, left))
        again = channel.peek_as("members", read)
        got = again if again is not None else got
    if node not in got.members:
        raise NodeLostError(
            f"node {node} was dropped from the job (attempt {got.attempt + 1} goes on with "
            f"node(s) {', '.join(map(str, got.members))}): it joined after node 0's window",
            node, "dropped")
    return got
