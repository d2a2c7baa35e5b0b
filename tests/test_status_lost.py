"""A status someone else took is not a verdict (issue 46, item 5): a script's own SIGCHLD handler
that reaps every child must never make a probe read as failed, nor leave that failure cached.

Forking probe workers in the deciding process is skipped while SIGCHLD has a handler (they start
as fresh interpreters, whose exit the runner reads with the handler set aside); a worker whose exit status was
taken anyway (``waitpid`` answers ECHILD) is ``status_lost``: no verdict, never cached, probed
once more. With a real handler (``signal.signal``), real forks and real probes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from conftest import deadline

from resilient_strategy.core.measures.probe import ERROR, OK, ProbeResult, ProbeSpec, parse_probe
from resilient_strategy.core.values.outcome import WorkerOutcome
from resilient_strategy.deciding.cache import DecisionCache, refusal
from resilient_strategy.probing import forkserver

SRC = str(Path(__file__).resolve().parents[1] / "src")
GLOO = "torch:gloo:cpu"


def _reap_all(signum: int, frame: FrameType | None) -> None:
    """What the issue's script does: reap every child that exited."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def test_a_python_sigchld_handler_rules_forking_here_out() -> None:
    before = signal.getsignal(signal.SIGCHLD)
    assert before == signal.SIG_DFL
    fit = forkserver.why_not_here()
    signal.signal(signal.SIGCHLD, _reap_all)
    try:
        assert forkserver.why_not_here() != ""  # refused
    finally:
        signal.signal(signal.SIGCHLD, before)
    assert forkserver.why_not_here() == fit


def test_a_child_reaped_by_another_reaper_has_its_status_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forkserver, "_LOST", [])
    before = signal.getsignal(signal.SIGCHLD)
    with warnings.catch_warnings():  # the child only exits (3.12 warns of a fork beside threads)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(0)
    signal.signal(signal.SIGCHLD, _reap_all)
    try:
        end = time.monotonic() + 30.0
        while time.monotonic() < end:  # the handler reaps it (or it already ended: reap now)
            _reap_all(signal.SIGCHLD, None)
            if not os.path.exists(f"/proc/{pid}"):
                break
            time.sleep(0.01)
        child = forkserver.ChildProc(pid)
        assert child.poll() == forkserver.LOST_STATUS
        assert child.status_lost
        assert forkserver.why_not_here() != ""  # no more forking here in this process
    finally:
        signal.signal(signal.SIGCHLD, before)


def _spec() -> ProbeSpec:
    return ProbeSpec(GLOO, "torch", "gloo", (), world_size=2, timeout_s=60.0)


def test_a_lost_status_is_no_verdict_and_is_never_cached(tmp_path: Path) -> None:
    ok = json.dumps({"status": "ok", "bus_bandwidth_gbps": 1.0})
    lost = parse_probe(_spec(), [
        WorkerOutcome(0, 70, report=ok, status_lost=True, failed_first=True),
        WorkerOutcome(1, None, killed_by_runner=True)], 1.0, False)
    assert (lost.status, lost.cause) == (ERROR, "status_lost")
    assert refusal(lost) is not None
    cache = DecisionCache(tmp_path)
    assert cache.store("fp", {GLOO: lost})
    assert cache.load("fp") == {}
    # a rank that said what went wrong still speaks for itself
    said = parse_probe(_spec(), [
        WorkerOutcome(0, 70, report=json.dumps({"status": "error", "error": "boom"}),
                      status_lost=True, failed_first=True),
        WorkerOutcome(1, None, killed_by_runner=True)], 1.0, False)
    assert said.cause != "status_lost"


def test_a_lost_status_is_probed_once_more_and_that_result_stands(tmp_path: Path) -> None:
    from resilient_strategy.core.call.arguments import Arguments, options_from
    from resilient_strategy.deciding.decide import decide
    from resilient_strategy.testing.simulation import machine

    facts = machine(gpus=0, cpu_count=4)
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    opts = options_from(facts, env, Arguments.from_kwargs(
        framework="torch", global_batch_size=32, cache=True, cache_dir=tmp_path))
    calls: list[str] = []

    def prober(spec: ProbeSpec, env: Any) -> ProbeResult:
        calls.append(spec.candidate)
        if len(calls) == 1:
            return ProbeResult(spec.candidate, ERROR, 1.0, "status_lost", "rank 0's status")
        return ProbeResult(spec.candidate, OK, 1.0, bus_bandwidth_gbps=1.0, ranks=2)

    made = decide(facts, opts, env, prober)
    assert calls == [GLOO, GLOO]
    assert made.plan.chosen is not None and made.plan.chosen.key == GLOO
    assert DecisionCache(tmp_path).load(facts.fingerprint())[GLOO].ok


def test_a_reaping_handler_never_turns_a_fresh_workers_exit_into_a_clean_one(
        tmp_path: Path) -> None:
    """Workers started as fresh processes (forking switched off or refused, TensorFlow): before, the
    script's handler reaped them first and ``subprocess`` read the lost status as 0, so a
    crashed worker looked like one that exited cleanly (5 of 5 here). Now the handler is set
    aside while the group runs, and called once after for what came meanwhile."""
    from resilient_strategy.probing.proc import WorkerCommand, run_group

    calls: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        calls.append(signum)
        _reap_all(signum, frame)

    cmd = WorkerCommand(argv=(sys.executable, "-c", "import sys; sys.exit(3)"),
                        env=dict(os.environ), cwd=str(tmp_path),
                        report_path=str(tmp_path / "report.json"))
    before = signal.getsignal(signal.SIGCHLD)
    signal.signal(signal.SIGCHLD, handler)
    try:
        codes = [run_group([cmd], 60.0).outcomes[0].returncode for _ in range(3)]
        assert signal.getsignal(signal.SIGCHLD) is handler  # put back
    finally:
        signal.signal(signal.SIGCHLD, before)
    assert codes == [3, 3, 3]
    assert calls  # the script's handler still heard of its children


SCRIPT = r'''
import json, os, signal, sys
sys.path.insert(0, sys.argv[1])
def reap(signum, frame):
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
signal.signal(signal.SIGCHLD, reap)   # the script's own handler, installed before the decision
import torch  # noqa: F401  (a training script has it imported: forking here would be fit)
from resilient_strategy.core.measures.probe import ProbeSpec
from resilient_strategy.probing import proc
from resilient_strategy.probing.prober import run_probe
kinds = []
real = proc.start_worker
def start_worker(*a, **k):
    p = real(*a, **k)
    kinds.append(type(p).__name__)
    return p
proc.start_worker = start_worker
spec = ProbeSpec("torch:gloo:cpu", "torch", "gloo", (), world_size=2, timeout_s=90.0,
                 message_bytes=1 << 16)
res = run_probe(spec, dict(os.environ))
print(json.dumps({"status": res.status, "cause": res.cause, "kinds": kinds}))
'''


@pytest.mark.slow
@pytest.mark.torch
def test_a_probe_under_a_reaping_sigchld_handler_passes(tmp_path: Path) -> None:
    """The issue's case, in a fresh process fit to fork: before, its workers were forked there,
    the handler took their exit statuses, and the probe read ``worker_error`` (cached after two
    runs: every later job got 'CPU from the cache')."""
    pytest.importorskip("torch")
    script = tmp_path / "reaper.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RESILIENT_STRATEGY_PROBE_FAULT", forkserver.FORKSERVER_VAR)}
    env.update(PYTHONPATH=SRC, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, str(script), SRC], env=env, capture_output=True,
                         text=True, timeout=deadline(240), check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert (seen["status"], seen["cause"]) == (OK, "")
    assert seen["kinds"] == ["Popen", "Popen"]  # fresh interpreters, not forked here
