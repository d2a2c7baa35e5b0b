"""Issue 45.7's held-out mid-run cases (tests/fixtures/midrun_heldout: public threads of faults in
the middle of a run, of kinds named in no earlier issue), each replayed through the testing kit's
replay (the supervisor's classifier and ladder) against the judgement its thread supports; a
case's ``known_miss`` states, as data, why it is not reached yet (strict: a case that starts
passing must drop it). benchmarks/bench_midrun_heldout.py prints the same as a table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from resilient_strategy.records.progress import COLLECTIVE, Record
from resilient_strategy.run.verdicts import (
    BLAME_GPU,
    BLAME_PROCESS_GROUP,
    BLAME_SCRIPT,
    RankExit,
    VerdictKind,
    blame,
    classify_attempt,
    placed_line,
)

ROOT = Path(__file__).parents[1]
CASES = ROOT / "tests" / "fixtures" / "midrun_heldout"
PLAN_CASES = ROOT / "tests" / "fixtures" / "field_heldout2"


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location(
        "bench_midrun_heldout", ROOT / "benchmarks" / "bench_midrun_heldout.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cases() -> list[Any]:
    out = []
    for p in sorted(CASES.glob("*.json")):
        miss = json.loads(p.read_text(encoding="utf-8")).get("known_miss")
        out.append(pytest.param(p, id=p.stem, marks=[pytest.mark.xfail(strict=True, reason=miss)]
                                if miss else []))
    return out


@pytest.mark.parametrize("path", _cases())
def test_a_held_out_mid_run_case_reaches_its_judgement(path: Path) -> None:
    ok, judged = _bench().judge(path)
    assert ok, judged


def test_the_held_out_set_is_sourced_and_large_enough() -> None:
    cases = [json.loads(p.read_text(encoding="utf-8"))
             for p in [*CASES.glob("*.json"), *PLAN_CASES.glob("*.json")]]
    assert len(cases) >= 15
    assert [c["what"] for c in cases if not str(c.get("source", "")).startswith("https://")] == []
    mid = [json.loads(p.read_text(encoding="utf-8")) for p in CASES.glob("*.json")]
    assert {c["family"] for c in mid} == {"mid_run"}
    assert all(c["expect"] and set(c["expect"]) <= _bench().EXPECT_KEYS for c in mid)


def _record(types: list[str], message: str, **extra: Any) -> dict[str, Any]:
    frames = [{"module": "__main__", "function": "train", "file": "train.py", "line": 9}]
    return {"rank": 1, "types": types, "message": message, "step": 40,
            "chain": [{"types": types, "message": message, "frames": frames}], **extra}


RT = ["builtins.RuntimeError", "builtins.Exception"]


@pytest.mark.parametrize(("message", "extra", "kind", "why"), [
    # the GPU's own failure, raised in the script's frame: the machine's, not the script's
    ("CUDA error: uncorrectable ECC error encountered", {}, "gpu", BLAME_GPU),
    ("CUDA error: uncorrectable NVLink error detected during the execution", {}, "gpu",
     BLAME_GPU),
    ("CUDA error: the launch timed out and was terminated", {}, "gpu", BLAME_GPU),
    # the same words while the process group held an error: its abort, a communication error
    ("CUDA error: unspecified launch failure", {"pg_error": "COMM_ERROR"}, "comm",
     BLAME_PROCESS_GROUP),
    # the process group's abort surfacing at the script's next CUDA sync
    ("NCCL communicator was aborted on rank 3. Original reason for failure was: [Rank 3] "
     "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=56693)", {}, "comm",
     BLAME_PROCESS_GROUP),
    # a cuBLAS failure of the script's own numerics stays the script's
    ("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx(...)`", {}, "user",
     BLAME_SCRIPT),
])
def test_whose_fault_a_cuda_error_in_the_scripts_frame_is(message: str, extra: dict[str, Any],
                                                           kind: str, why: str) -> None:
    got = blame(_record(RT, message, **extra))
    assert (got.kind, got.why) == (kind, why)


WATCHDOG_ECC = ("[E ProcessGroupNCCL.cpp:916] [Rank 1] NCCL watchdog thread terminated with "
                "exception: CUDA error: uncorrectable ECC error encountered\nterminate called "
                "after throwing an instance of 'c10::DistBackendError'\n")
TF_TIMEOUT = ("E tensorflow/stream_executor/cuda/cuda_event.cc:48] Error polling for event status: "
              "failed to query event: CUDA_ERROR_LAUNCH_TIMEOUT: the launch timed out and was "
              "terminated; not marking stream as bad\nF tensorflow/core/common_runtime/gpu/"
              "gpu_event_mgr.cc:274] Unexpected Event status: 1\n")


def test_an_abort_that_printed_a_gpu_fault_is_an_exit_of_the_machine_never_a_backend() -> None:
    """NCCL's watchdog reporting a CUDA error of the GPU (SIGABRT, no Python record): the NCCL
    words are not the transport's; a GPU fault, retried once, never stepped down at once."""
    here = Record(seq=3, phase=COLLECTIVE, k=40, t=0.0)
    verdict = classify_attempt(None, [RankExit(1, -6, None, here, WATCHDOG_ECC)])
    assert (verdict.kind, verdict.cause, verdict.ranks) == (VerdictKind.EXIT, "gpu_fault", (1,))
    assert verdict.blame == BLAME_GPU


@pytest.mark.parametrize(("tail", "token"), [(WATCHDOG_ECC, "uncorrectable ECC error"),
                                              (TF_TIMEOUT, "CUDA_ERROR_LAUNCH_TIMEOUT")])
def test_the_line_a_signature_placed_is_quoted_from_its_clause(tail: str, token: str) -> None:
    """The verbatim clause the signature table matched, without the log line's prefix or the
    next clause; and that quote is in what a signalled rank's exit says."""
    quoted = placed_line(tail, 100)
    assert quoted.startswith(token.split()[0]) and token in quoted and "; " not in quoted
    assert token in RankExit(0, -6, None, None, tail).what()
    assert placed_line("nothing placed here\n") == ""
