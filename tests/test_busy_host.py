"""Load is not a fault (issue 41 item 5): a probe cut while its host was too busy to run it is
judged from the CPU its workers got (pure, from numbers), retried with a deadline scaled to that
share, said in the trace, and never cached as a failure of the transport."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from resilient_strategy.core.call.options import Options
from resilient_strategy.core.knowledge.rules import load_rules
from resilient_strategy.core.measures.probe import (
    BUSY_RETRIED,
    HOST_BUSY,
    OK,
    TIMEOUT,
    ProbeResult,
)
from resilient_strategy.core.planning.plan import plan
from resilient_strategy.core.trace.choosing import HostBusy
from resilient_strategy.deciding.cache import DecisionCache, refusal
from resilient_strategy.machine.procs import parse_cpu_steal, parse_schedstat
from resilient_strategy.probing import proc
from resilient_strategy.probing.cost import (
    MAX_BUSY_SCALE,
    CpuShare,
    busy_retry_timeout,
    got_share,
    host_busy,
)
from resilient_strategy.probing.prober import (
    RETRY_TIMEOUT,
    after_busy_retry,
    busy_retry_deadline,
)
from resilient_strategy.testing import machine

KEY = "torch:gloo:0,1"


# ----- the judgement, from numbers ------------------------------------------------------------
def test_a_worker_that_waited_for_a_cpu_most_of_the_time_ran_on_a_busy_host() -> None:
    # the loaded 2-core machine (load ~16): each worker got ~1/8 of a CPU
    loaded = CpuShare(wall_s=30.0, on_cpu_s=(3.5, 3.8), waited_s=(26.0, 25.5))
    assert host_busy(loaded)
    assert got_share(loaded) == pytest.approx(3.5 / 29.5)
    assert busy_retry_timeout(30.0, loaded, 600.0) == 30.0 * MAX_BUSY_SCALE  # 1/8.4: capped


def test_a_worker_blocked_in_a_collective_is_a_hang_not_load() -> None:
    # a hung gloo rank sleeps in recv: little CPU, and no wait for one either
    hung = CpuShare(wall_s=30.0, on_cpu_s=(0.2, 0.2), waited_s=(0.05, 0.04))
    assert not host_busy(hung)
    spinning = CpuShare(wall_s=30.0, on_cpu_s=(29.0, 29.5), waited_s=(0.6, 0.3))  # NCCL's spin
    assert not host_busy(spinning)
    assert not host_busy(None)


def test_a_vms_stolen_time_is_load_too() -> None:
    stolen = CpuShare(wall_s=30.0, on_cpu_s=(15.0,), waited_s=(1.0,), steal=0.5)
    assert host_busy(stolen)
    assert got_share(stolen) == pytest.approx(15.0 / 16.0 * 0.5)


def test_the_retry_deadline_is_scaled_within_its_bounds() -> None:
    starved = CpuShare(wall_s=30.0, on_cpu_s=(0.1,), waited_s=(29.9,))
    assert busy_retry_timeout(30.0, starved, 10_000.0) == 30.0 * MAX_BUSY_SCALE
    assert busy_retry_timeout(30.0, starved, 100.0) == 100.0  # the cap
    half = CpuShare(wall_s=30.0, on_cpu_s=(10.0,), waited_s=(10.0,))
    assert busy_retry_timeout(30.0, half, 600.0) == 60.0
    assert busy_retry_timeout(30.0, half, 10.0) == 30.0  # never below the deadline it had


def test_schedstat_and_proc_stat_lines_parse() -> None:
    assert parse_schedstat("503123456 1493000000 812\n") == (503123456, 1493000000)
    assert parse_schedstat("") is None and parse_schedstat("x y z") is None
    stat = "cpu  134773 0 18396 92312 716 0 305 930 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"
    assert parse_cpu_steal(stat) == (134773 + 18396 + 92312 + 716 + 305 + 930, 930)
    assert parse_cpu_steal("intr 1 2 3\n") is None


# ----- what the runner reads of real workers ------------------------------------------------------
def _workers(code: str, n: int, tmp: Path) -> list[proc.WorkerCommand]:
    return [proc.WorkerCommand((sys.executable, "-c", code), dict(os.environ), str(tmp),
                               str(tmp / f"report-{i}.json")) for i in range(n)]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or not os.path.exists(
    f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat"), reason="Linux schedstat")
def test_workers_starved_of_a_cpu_read_busy_and_sleeping_ones_do_not(tmp_path: Path) -> None:
    # four spinning workers on one CPU: each waits for it about 3/4 of the time, whatever else
    # the machine runs; two sleeping ones wait for nothing
    spin = "import os\nos.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\nwhile True: pass"
    busy = proc.run_group(_workers(spin, 4, tmp_path), 2.0)
    assert busy.timed_out and busy.share is not None and len(busy.share.waited_s) == 4
    assert host_busy(busy.share)
    idle = proc.run_group(_workers("import time\ntime.sleep(120)", 2, tmp_path), 2.0)
    assert idle.timed_out and idle.share is not None and not host_busy(idle.share)
    done = proc.run_group(_workers("pass", 1, tmp_path), 60.0)
    assert not done.timed_out and done.share is None  # not cut: nothing to judge


# ----- the retry, the cache, the trace ------------------------------------------------------------
def _busy_timeout() -> ProbeResult:
    return ProbeResult(KEY, TIMEOUT, 30.0, "timeout", "did not finish within 30 s",
                       extra=((HOST_BUSY, "0.12"), (RETRY_TIMEOUT, "240")))


def test_a_busy_timeout_is_retried_once_with_its_scaled_deadline() -> None:
    first = _busy_timeout()
    assert busy_retry_deadline(first) == 240.0
    assert busy_retry_deadline(ProbeResult(KEY, TIMEOUT, 30.0, "timeout")) is None  # not busy
    passed = after_busy_retry(first, ProbeResult(KEY, OK, 95.0, bus_bandwidth_gbps=0.4), 240.0)
    assert passed.ok and dict(passed.extra) == {HOST_BUSY: "0.12", BUSY_RETRIED: "240"}
    again = after_busy_retry(first, _busy_timeout(), 240.0)
    assert dict(again.extra)[BUSY_RETRIED] == "240" and busy_retry_deadline(again) is None


def test_a_probe_across_workers_is_not_retried_alone() -> None:
    """A TF_CONFIG worker's (or a node's) probe is one side of a collective: the others' probes
    have ended when this one is cut, so a retry here alone meets no one and reads as an error
    (seen under a loaded suite: worker 0 'error', worker 1 'timeout'). It stays a busy timeout."""
    first = _busy_timeout()
    assert busy_retry_deadline(first, workers=1) == 240.0
    assert busy_retry_deadline(first, workers=2) is None


def test_a_deadline_lost_to_load_is_never_cached(tmp_path: Path) -> None:
    busy = ProbeResult(KEY, TIMEOUT, 30.0, "timeout", extra=(("host_busy", "0.12"),))
    assert refusal(busy) is not None
    assert refusal(ProbeResult(KEY, TIMEOUT, 30.0, "timeout")) is None  # a hang is cached
    cache = DecisionCache(tmp_path)
    cache.store("f", {KEY: busy})
    assert cache.load("f") == {}
    passed = ProbeResult(KEY, OK, 95.0, extra=((HOST_BUSY, "0.12"), (BUSY_RETRIED, "240")))
    cache.store("f", {KEY: passed})
    assert set(cache.load("f")) == {KEY}  # a pass on a busy host is a pass


def test_the_trace_says_the_host_was_busy() -> None:
    facts = machine(2, torch="2.11.0")
    policy = Options("torch", global_batch_size=64, world_size=2)
    nccl = "torch:nccl:0,1"
    results = {nccl: ProbeResult(nccl, OK, 95.0, bus_bandwidth_gbps=80.0,
                                 extra=((HOST_BUSY, "0.12"), (BUSY_RETRIED, "240")))}
    p = plan(facts, load_rules(), results, policy)
    assert p.chosen is not None and p.chosen.key == nccl
    events = [e for e in p.events if isinstance(e, HostBusy)]
    assert [(e.candidate.key, e.got, e.retried_s, e.passed) for e in events] == [
        (nccl, 0.12, 240.0, True)]
