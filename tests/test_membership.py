"""Nodes that come and go (nodes/membership.py, run/peers.py): who is in each attempt, who left
and how it was seen, and a node of the attempt that stops beating seen within the window.

The store is an in-memory stand-in with the TCPStore calls the supervisors use; the clock is
an argument. The bed (tests/test_testbed.py) runs the same code on real links."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from _fake_store import FakeClock, FakeStore

from resilient_strategy.errors import NodeLostError
from resilient_strategy.nodes import membership as ms
from resilient_strategy.nodes.store import HEARTBEAT_STALE_S, Channel


def test_the_nodes_of_an_attempt_are_node_0_and_whoever_joined() -> None:
    # three nodes, node 2 vanished (its verdict never came): nodes 0 and 1 go on
    c = ms.members_of(1, (0, 1, 2), {0, 1}, {2: ms.NO_VERDICT}, 3)
    assert (c.members, c.left, c.joined) == ((0, 1), ((2, ms.NO_VERDICT),), ())
    # a node that gave its verdict and then did not join is named as such
    c = ms.members_of(1, (0, 1, 2), {1}, {}, 3)
    assert (c.members, c.left) == ((0, 1), ((2, ms.NOT_JOINED),))
    # a node back (or new) joins a later attempt, never beyond MAX nodes or outside 0..MAX-1
    c = ms.members_of(2, (0, 1), {1, 2, 7}, {}, 3)
    assert (c.members, c.left, c.joined) == ((0, 1, 2), (), (2,))
    # the first attempt has nobody "new": everyone starts
    assert ms.members_of(0, (0, 1, 2), {1, 2}, {}, 3).joined == ()


def test_a_change_round_trips_through_the_store_record() -> None:
    c = ms.Change(3, (0, 2), ((1, ms.CUT_OFF),), (2,), 1.5e9, {1: 10.0})
    back = ms.Change.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back == c and back.changed
    assert not ms.Change(0, (0, 1)).changed and ms.Change(0, (0, 1)).line() == ""


def test_node_0_gives_a_node_known_gone_the_heartbeat_window_then_publishes_who_is_in() -> None:
    store = FakeStore()
    ch = Channel(store, "p/members/")
    ms.join(ch, 0)
    ms.join(ch, 1)  # node 2 never joins: it vanished in the last attempt
    got = ms.gather(ch, 1, (0, 1, 2), {2: ms.NO_VERDICT}, window_s=30.0, max_nodes=3,
                    quick_s=0.2)
    assert (got.members, got.left, got.seen_s) == ((0, 1), ((2, ms.NO_VERDICT),), {2: 0.2})
    # every other node reads the same record
    assert ms.await_members(ch, 1, 1.0).members == (0, 1)
    with pytest.raises(NodeLostError) as err:  # node 2, late: dropped, named, typed
        ms.await_members(ch, 2, 1.0)
    assert (err.value.node, err.value.how) == (2, "dropped")


def test_a_node_that_joins_is_taken_without_waiting_out_the_window() -> None:
    store = FakeStore()
    ch = Channel(store, "p/members/")
    for n in (0, 1, 2):
        ms.join(ch, n)
    # a window that would fail the test if waited out (the test's own timeout), not a timing
    got = ms.gather(ch, 0, (0, 1, 2), {}, window_s=3600.0, max_nodes=3)
    assert (got.members, got.left) == ((0, 1, 2), ())


def _link(node: int, members: tuple[int, ...] = ()) -> Any:
    from resilient_strategy.run.peers import NodeLink

    return NodeLink(node=node, nodes=3, nproc=1, host="198.18.0.1", port=29400, run_id="bed",
                    members=members, min_nodes=3, floor=1)


def _watch(link: Any, store: FakeStore, clock: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    from resilient_strategy.run import peers

    monkeypatch.setattr(peers, "open_store", lambda job, timeout_s, client=False: store)
    return peers.PeerWatch(link, 0, 10.0, clock)


def test_a_node_of_the_attempt_that_stops_beating_is_lost_within_the_window(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient_strategy.run.verdicts import VerdictKind

    store, clock = FakeStore(), FakeClock()
    peer = _watch(_link(0), store, clock, monkeypatch)
    try:
        prefix = peer.job.prefix
        store.add(f"{prefix}beat/1", 1)  # node 1 beats; node 2 never does
        peer.faults()
        assert peer.poll() is None  # within the window
        clock.t += HEARTBEAT_STALE_S / 2
        store.add(f"{prefix}beat/1", 1)
        peer.faults()
        assert peer.poll() is None
        clock.t += HEARTBEAT_STALE_S / 2 + 0.5
        store.add(f"{prefix}beat/1", 1)
        peer.faults()
        fault = peer.poll()
        assert fault is not None and (fault.node, fault.verdict.kind) == (2, VerdictKind.LOST)
    finally:
        peer.close()


def test_a_node_cut_off_does_not_blame_the_others_it_cannot_hear(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient_strategy.run.verdicts import VerdictKind

    store, clock = FakeStore(), FakeClock()
    peer = _watch(_link(1), store, clock, monkeypatch)
    try:
        store.up = False  # node 1's link is down: nobody's beat moves, nor does its contact
        clock.t += HEARTBEAT_STALE_S + 0.5
        fault = peer.poll()
        assert fault is not None and (fault.node, fault.verdict.kind) == (1, VerdictKind.CUT_OFF)
    finally:
        peer.close()


def test_a_peer_that_left_its_verdict_is_not_lost_for_going_quiet(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a node that finished writes "ok" and stops beating: it is not lost
    from resilient_strategy.nodes.store import record_fault
    from resilient_strategy.run.verdicts import PeerFault, Verdict, VerdictKind

    store, clock = FakeStore(), FakeClock()
    link = _link(0, (0, 2))
    peer = _watch(link, store, clock, monkeypatch)
    try:
        # node 2 is the second member: its records are under its place (1) in this attempt
        record_fault(store, _link(2, (0, 2)).job(0), PeerFault(2, "torch:gloo:cpu", Verdict(
            VerdictKind.OK, "finished")).to_dict())
        clock.t += HEARTBEAT_STALE_S + 1
        assert [f.node for f in peer.faults()] == [2]  # read under node 2's own name
        assert peer.poll() is None
    finally:
        peer.close()


def test_the_verdicts_that_never_came_name_the_nodes_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient_strategy.run.verdicts import PeerFault, Verdict, VerdictKind

    store, clock = FakeStore(), FakeClock()
    peer = _watch(_link(0, (0, 1, 2)), store, clock, monkeypatch)
    try:
        peer.record(PeerFault(0, "torch:gloo:cpu", Verdict(VerdictKind.EXIT, "x", 8, "crash")))
        from resilient_strategy.nodes.store import record_fault

        record_fault(store, _link(1, (0, 1, 2)).job(0), PeerFault(1, "torch:gloo:cpu", Verdict(
            VerdictKind.EXIT, "y", 8, "crash")).to_dict())
        faults = peer.await_all(0.0)
        assert [(f.node, f.verdict.kind) for f in faults] == [
            (0, VerdictKind.EXIT), (1, VerdictKind.EXIT), (2, VerdictKind.LOST)]
        assert peer.gone() == {2: ms.NO_VERDICT}
    finally:
        peer.close()


def test_attempts_json_records_each_attempts_nodes_and_the_summary_names_them(
        tmp_path: Path) -> None:
    from resilient_strategy.run.evidence import Evidence
    from resilient_strategy.run.peers import nodes_words

    changes = [ms.Change(0, (0, 1, 2)),
               ms.Change(1, (0, 1), ((2, ms.NO_VERDICT),), (), 1.0, {2: 10.0})]
    ev = Evidence(tmp_path, "rs-run-1")
    ev.dir.mkdir(parents=True)
    path = ev.summary([], [c.to_dict() for c in changes])
    assert path is not None
    data = json.loads(Path(path).read_text())
    assert [m["members"] for m in data["membership"]] == [[0, 1, 2], [0, 1]]
    assert data["membership"][1]["left"] == [{"node": 2, "how": "no_verdict", "waited_s": 10.0}]
    assert nodes_words(changes) == " Nodes per attempt: 1: 0,1,2; 2: 0,1."
    assert nodes_words([]) == ""


def test_a_wait_on_the_store_is_left_as_soon_as_the_peer_watch_sees_a_fault() -> None:
    # torch's rendezvous (and its handler's store client) wait a minute or more on a store
    # behind a link that is down; the agent leaves them for what the watch saw
    from resilient_strategy.run.agent import LeftRendezvous, watched
    from resilient_strategy.run.verdicts import PeerFault, Verdict, VerdictKind

    never = threading.Event()
    cut = PeerFault(1, "", Verdict(VerdictKind.CUT_OFF, "cut off", node=1))

    class Peer:
        def __init__(self, fault: PeerFault | None) -> None:
            self.fault = fault

        def poll(self) -> PeerFault | None:
            return self.fault

    with pytest.raises(LeftRendezvous) as left:
        watched(never.wait, Peer(cut))  # type: ignore[arg-type]
    assert left.value.fault == cut
    assert watched(lambda: 7, Peer(None)) == 7  # type: ignore[arg-type]
    assert watched(lambda: 8, None) == 8

    def fails() -> None:
        raise RuntimeError("the rendezvous closed")

    with pytest.raises(RuntimeError):
        watched(fails, Peer(None))  # type: ignore[arg-type]
    never.set()


def test_every_call_on_the_jobs_store_is_bounded_by_the_heartbeat_window() -> None:
    # connecting may take the whole timeout (the nodes start apart); a call that takes longer
    # than the window is a store out of reach: a node cut off in the membership round or the
    # agreement knows it in seconds, not after the probe's timeout plus its margin
    pytest.importorskip("torch")
    import socket

    from resilient_strategy.nodes.store import Job, open_store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    job = Job(node=0, nodes=2, local_world=1, rank=0, master_addr="127.0.0.1",
              master_port=port, agent_store=False, prefix="p/")
    host = open_store(job, 90.0)
    client = open_store(job, 90.0, client=True)
    assert host.timeout.total_seconds() == client.timeout.total_seconds() == HEARTBEAT_STALE_S
    assert open_store(job, 3.0, client=True).timeout.total_seconds() == 3.0


def test_node_0_stops_the_attempt_for_a_node_that_asks_to_join(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient_strategy.run.policy import Action, RelaunchPolicy, judge
    from resilient_strategy.run.verdicts import VerdictKind

    store, clock = FakeStore(), FakeClock()
    link = _link(0, (0, 1))  # node 2 was lost: two of three nodes run
    peer = _watch(link, store, clock, monkeypatch)
    try:
        store.add(f"{peer.job.prefix}beat/1", 1)
        peer.faults()
        assert peer.poll() is None
        ms.join(Channel(store, link.roster(1).prefix), 2)  # node 2 is back: the next attempt
        peer.faults()
        fault = peer.poll()
        assert fault is not None and (fault.node, fault.verdict.kind) == (0, VerdictKind.JOIN)
        j = judge(fault.verdict, "torch:gloo:cpu", [], RelaunchPolicy())
        assert (j.action, j.exit_code) == (Action.MORE_NODES, None)
    finally:
        peer.close()
    full = _watch(_link(0), store, clock, monkeypatch)  # all three present: no one to take in
    try:
        ms.join(Channel(store, _link(0).roster(1).prefix), 2)
        full.faults()
        assert full.poll() is None
    finally:
        full.close()


def test_a_node_that_comes_back_joins_the_running_jobs_next_attempt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient_strategy.run import peers

    store = FakeStore()
    monkeypatch.setattr(peers, "open_store", lambda job, timeout_s, client=False: store)
    base = "resilient_strategy/v1/run-bed/"
    ms.publish_current(store, base, ms.Change(4, (0, 1), ((2, ms.NO_VERDICT),)))
    # node 0's round of attempt 5, as it publishes it once node 2 asked
    Channel(store, _link(0).roster(5).prefix).put(
        "members", ms.Change(5, (0, 1, 2), (), (2,)).to_dict())
    link, change = peers.regroup(_link(2), 0, {}, 1.0, 1.0)  # its supervisor's first round
    assert (change.attempt, link.present, link.position, change.joined) == (5, (0, 1, 2), 2, (2,))
    assert store.check([_link(0).roster(5).prefix + "join/2"])  # it asked there


def test_a_join_outranks_the_connection_errors_it_causes_on_another_node() -> None:
    """The nodes stop their workers for a node asking to join; one node's ranks may see their
    peers go first and raise a connection error (seen on the bed: `Read error` at step 53, then
    a step-down from the fault rate). The merged verdict is the join, on every node."""
    from resilient_strategy.run.verdicts import PeerFault, Verdict, VerdictKind, merge

    key = "torch:gloo:cpu"
    faults = [PeerFault(0, key, Verdict(VerdictKind.BACKEND, "Read error", 53, "gloo_error",
                                        blame="collective_region", seen="error_record")),
              PeerFault(1, key, Verdict(VerdictKind.JOIN, "node 2 asks to join", 53))]
    for order in (faults, faults[::-1]):
        merged = merge(order)
        assert merged is not None and (merged.kind, merged.node) == (VerdictKind.JOIN, 1)
    # a rank that vanished is still the root cause before a join
    lost = PeerFault(2, key, Verdict(VerdictKind.EXIT, "rank 4 was killed", 53))
    merged = merge([*faults, lost])
    assert merged is not None and merged.kind is VerdictKind.EXIT
