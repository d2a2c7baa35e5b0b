"""What a decision and a fault print, pinned by length and structure (issue 32): a decision is
one line by default, ``explain()`` fits a screen, a fault is one line with its evidence's path.

Asserts on lengths, line counts, the data the lines carry (labels, ranks, paths) and typed
fields (``decided_by``, ``Ranking.known_size``), never on the English around them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

from resilient_strategy.core.trace.choosing import Ranking
from resilient_strategy.core.trace.event import Note
from resilient_strategy.records.flightdump import FlightFacts, StuckCollective
from resilient_strategy.records.progress import COLLECTIVE, Record, Stall
from resilient_strategy.run import verdicts as v
from resilient_strategy.selection import (
    DECIDED_BY,
    EXPLAIN_CHARS,
    EXPLAIN_LINES,
    SUMMARY_CHARS,
    Selection,
)
from resilient_strategy.testing import machine, simulate

MACHINES = Path(__file__).resolve().parents[1] / "examples" / "machines"

#: What gloo 2.13 raised on a rank whose peer died mid-collective (measured on this machine:
#: two processes, rank 1 exited after the first all-reduce, rank 0 all-reduced again).
GLOO_PEER_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:{port}. This is typically caused by a remote worker crashing. Check "
    "the logs of the remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f")
EVIDENCE = "resilient-strategy-evidence/rs-run-12345-abcdefgh/attempt1.txt"


def _torch_pair(**kwargs: Any) -> Selection:
    f = machine(2)
    return simulate(f, {"nccl": "ok"}, framework="torch", global_batch_size=256,
                    env={**f.env_map, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"},
                    **kwargs)


def _machine_cases() -> list[tuple[str, Selection]]:
    from resilient_strategy import cli
    from resilient_strategy.errors import ResilientStrategyError

    out = []
    for path in sorted(MACHINES.glob("*.json")):
        facts, sim = cli.load_simulation(path)
        for fw in cli._frameworks(facts, sim.get("framework")):
            args = cli.build_parser().parse_args(["plan", "--simulate", str(path)])
            try:
                out.append((f"{path.name}:{fw}", cli._decide(args, facts, sim, fw, {})))
            except ResilientStrategyError:  # a case that expects an error decides nothing
                continue
    return out


# ----- the decision -------------------------------------------------------------------------
def test_the_default_decision_line_is_one_line_with_the_choice_and_its_split() -> None:
    sel = _torch_pair()
    line = sel.summary()
    assert "\n" not in line and len(line) <= SUMMARY_CHARS
    c = sel.candidate
    split = (f"({sel.num_replicas} x {sel.per_replica_batch_size} x {sel.accumulation_steps} "
             f"= global batch {sel.global_batch_size})")
    assert line.index(c.label) < line.index(split)
    assert sel.decided_by == "simulation" and sel.decided_by in DECIDED_BY


def test_explain_fits_a_screen_and_verbose_has_the_whole_trace() -> None:
    cases = _machine_cases()
    assert len(cases) >= 6
    for name, sel in cases:
        short = sel.explain().splitlines()
        assert short[0] == sel.summary(), name
        assert len(short) <= EXPLAIN_LINES, name
        assert max(map(len, short)) <= EXPLAIN_CHARS, name
        assert len(sel.summary()) <= SUMMARY_CHARS and "\n" not in sel.summary(), name
        whole = sel.explain(verbose=True).splitlines()
        assert len(whole) >= len(sel.plan.trace) + 2, name  # header, "Why:", one per event
        # every candidate ruled out is named on the short screen, or counted there
        named = [r for r in sel.plan.ruled_out if r.candidate.label in "\n".join(short)]
        assert named or not sel.plan.ruled_out, name


def test_a_relaunched_worker_names_one_source_of_its_decision() -> None:
    sel = _torch_pair()
    handed = replace(sel, simulated=False, from_cache=True, plan=replace(
        sel.plan, events=(*sel.plan.events, Note("handed_down", "x"))))
    assert handed.handed_down and handed.decided_by == "run"
    assert replace(handed, plan=sel.plan).decided_by == "cache"


def test_an_unknown_model_size_is_ranked_without_seconds_a_known_one_with() -> None:
    unknown = next(e for e in _torch_pair().plan.events if isinstance(e, Ranking))
    known = next(e for e in _torch_pair(gradient_bytes=4 << 20).plan.events
                 if isinstance(e, Ranking))
    assert (unknown.known_size, known.known_size) == (False, True)
    steps = [f"~{e.step_seconds}" for e in unknown.entries]
    assert not any(s in unknown.text() for s in steps)
    assert all(e.candidate.label in unknown.text() for e in unknown.entries)


# ----- the fault ----------------------------------------------------------------------------
def _gloo_exits(ranks: tuple[int, ...] = (0, 1, 2)) -> list[v.RankExit]:
    rec = Record(seq=3, phase=COLLECTIVE, k=7)
    return [v.RankExit(rank=r, exitcode=1, record=rec, error={
        "types": ["torch.distributed.DistBackendError", "builtins.RuntimeError"],
        "message": GLOO_PEER_CLOSED.format(port=34978 + r)}) for r in ranks]


def test_the_fault_line_fits_with_its_evidence_and_says_the_error_once() -> None:
    verdict = v.classify_attempt(None, _gloo_exits(), [Record(seq=3, phase=COLLECTIVE, k=7)] * 3)
    assert verdict.kind is v.VerdictKind.BACKEND and verdict.ranks == (0, 1, 2)
    prefix = "resilient-strategy run: "
    line = v.fault_line(0, "gloo", verdict, EVIDENCE, prefix=prefix)
    assert len(line) <= v.FAULT_CHARS and "\n" not in line
    assert line.startswith(prefix) and line.endswith(EVIDENCE)
    assert line.isascii() and "GLHF" not in line
    assert line.count("Connection closed by peer") == 1  # gloo's words, once for three ranks
    # the summary (evidence file, records) names the three ranks together, the error once
    assert verdict.summary.count("Connection closed by peer") == 1


@pytest.mark.parametrize("evidence", [EVIDENCE, "/" + "very-long-directory/" * 6 + "attempt1.txt"])
def test_the_evidence_path_is_never_cut(evidence: str) -> None:
    verdict = v.classify_attempt(None, _gloo_exits(), [])
    line = v.fault_line(2, "nccl+NCCL_P2P_DISABLE=1", verdict, evidence)
    assert line.endswith(evidence)
    assert len(line) <= max(v.FAULT_CHARS, len(evidence) + 80)


def test_a_stall_the_flight_recorder_saw_names_the_ranks_as_it_does() -> None:
    stall = Stall("collective", COLLECTIVE, 3, (0, 1), 31.0, 30.0, ("collective 3",) * 2)
    verdict = replace(v.classify_attempt(stall, []), flight=FlightFacts(
        ranks=(), stuck=StuckCollective("0", 12, "allreduce", entered=(0,), missing=(1,))))
    line = v.fault_line(0, "nccl", verdict, EVIDENCE)
    assert len(line) <= v.FAULT_CHARS and line.endswith(EVIDENCE)
    entered, never = line.index("rank 0"), line.index("rank 1")
    assert entered < never  # the rank that entered, then the one that never did
    assert "ranks 0, 1" not in line and "ranks 0-1" not in line  # never both called stuck
    # the evidence file's longer line says it the same way
    assert "ranks 0, 1" not in verdict.line()


def test_quiet_and_error_words_drop_noise_keep_the_cause() -> None:
    text = GLOO_PEER_CLOSED.format(port=1)
    assert v.quiet(f"{text}; {text}") == v.quiet(text)
    words = v.error_words(f"DistBackendError: {text}")
    assert words.isascii() and "pair.cc" not in words and "127.0.0.1" not in words
    assert words and words in v.quiet(text)
    assert v.error_words("RuntimeError") == "RuntimeError"  # a bare type is all there is


def test_the_verdict_detail_crosses_the_record() -> None:
    verdict = v.classify_attempt(None, _gloo_exits((0,)), [])
    assert verdict.detail
    assert v.Verdict.from_dict(json.loads(json.dumps(verdict.to_dict()))).detail == verdict.detail


# ----- on GPUs: the flight recorder's variable is the one the installed torch reads ---------
WORKER_ENV = '''import json, os, resilient_strategy
sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=64)
if sel.is_main_process:
    print("ENV " + json.dumps({"backend": sel.backend, **{k: os.environ.get(k) for k in (
        "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")}}), flush=True)
'''


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_run_sets_the_recorder_variable_this_torch_reads(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from resilient_strategy.machine.versions import detect_frameworks
    from resilient_strategy.records import flight

    if os.environ.get("RS_GPU_TESTS") != "1":
        pytest.skip("set RS_GPU_TESTS=1 on a machine with 2 CUDA GPUs")
    script = tmp_path / "env_worker.py"
    script.write_text(WORKER_ENV)
    env = {k: v for k, v in os.environ.items()
           if k not in (flight.BUFFER_VAR, flight.FR_BUFFER_VAR)}
    env["RESILIENT_STRATEGY_CACHE_DIR"] = str(tmp_path / "cache")
    out = subprocess.run([sys.executable, "-m", "resilient_strategy", "run", "--nproc-per-node",
                          "2", "--evidence-dir", str(tmp_path / "ev"), str(script)],
                         capture_output=True, text=True, timeout=deadline(300), env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(next(ln[4:] for ln in out.stdout.splitlines() if ln.startswith("ENV ")))
    if seen["backend"] != "nccl":
        pytest.skip(f"NCCL was not chosen here ({seen['backend']})")
    wanted = flight.buffer_var(detect_frameworks()[0].version)
    other = ({flight.BUFFER_VAR, flight.FR_BUFFER_VAR} - {wanted}).pop()
    assert seen[wanted] == str(flight.DEFAULT_ENTRIES) and seen[other] is None
    assert other not in out.stderr  # torch's deprecation warning names the other one
