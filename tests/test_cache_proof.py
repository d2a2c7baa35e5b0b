"""Only proof is cached (issue 22.1): never a failure a training process met mid-run, never a
failure of the candidate of last resort, never a cause of the machine's state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resilient_strategy.core.measures.probe import (
    ENVIRONMENTAL_CAUSES,
    ERROR,
    ProbeResult,
    classify,
)
from resilient_strategy.deciding.cache import (
    MID_RUN,
    DecisionCache,
    last_resort,
    refusal,
)
from resilient_strategy.deciding.decide import LOW_SPACE_BYTES, space_short
from resilient_strategy.run.policy import mid_run_failure
from resilient_strategy.run.verdicts import RankExit, VerdictKind, classify_attempt
from resilient_strategy.testing import machine, simulate

NCCL = "torch:nccl:0,1"


def _midrun(key: str, step: int = 7, cause: str = "crash") -> ProbeResult:
    """A mid-run failure as the supervisor builds it from a verdict."""
    return ProbeResult(key, ERROR, 0.0, cause, f"failed mid-run at step {step}",
                       extra=((MID_RUN, str(step)),))


@pytest.mark.parametrize(("result", "refused"), [
    (ProbeResult(NCCL, "ok", 3.0), False),
    (ProbeResult(NCCL, ERROR, 3.0, "nccl_error"), False),  # a probe's own failure: proof
    (ProbeResult("torch:cpu:cpu", "ok"), False),
    (ProbeResult("torch:cpu:cpu", ERROR, 0.0, "worker_error"), True),  # last resort
    (ProbeResult("torch:single_device:0", ERROR, 0.0, "cuda_error"), True),
    (ProbeResult(NCCL, ERROR, 3.0, "no_space"), True),  # the machine's state
    (ProbeResult(NCCL, ERROR, 3.0, "too_many_files"), True),
    (ProbeResult(NCCL, ERROR, 3.0, "permission"), True),
    (_midrun(NCCL), True),  # a classification of exception text, unproven
    (ProbeResult(NCCL, ERROR, 0.0, "crash", extra=(("rehearsal", "1"),)), True),
])
def test_what_may_be_cached(result: ProbeResult, refused: bool) -> None:
    assert (refusal(result) is not None) == refused


def test_last_resort_is_one_device_or_cpu() -> None:
    assert [last_resort(k) for k in ("torch:cpu:cpu", "torch:single_device:0",
                                     "tensorflow:single_device:0", NCCL, "torch:gloo:0,1",
                                     "tensorflow:hierarchical_copy:0,1")] == \
        [True, True, True, False, False, False]


@pytest.mark.parametrize(("text", "cause"), [
    ("OSError: [Errno 28] No space left on device: '/tmp/rs-probe-1/x'", "no_space"),
    ("RuntimeError: Too many open files. Communication with the workers is no longer possible",
     "too_many_files"),
    ("PermissionError: [Errno 13] Permission denied: '/tmp/x'", "permission"),
    # the backend's words printed on the way out do not hide the full disk
    ("NCCL error: unhandled system error ... No space left on device", "no_space"),
])
def test_environmental_causes_are_their_own(text: str, cause: str) -> None:
    assert classify(text) == cause and cause in ENVIRONMENTAL_CAUSES


def _user_error_verdict(types: list[str], message: str, key: str = "torch:cpu:cpu"
                        ) -> ProbeResult:
    """The supervisor's path: a rank's exception record -> verdict -> the mid-run failure the
    step-down hands the plan (`policy.mid_run_failure`)."""
    verdict = classify_attempt(None, [RankExit(0, 1, {"types": types, "message": message})])
    assert verdict.kind is VerdictKind.BACKEND  # the classifier takes it for a backend fault...
    return mid_run_failure(key, verdict)


@pytest.mark.parametrize(("types", "message"), [
    (["ConnectionResetError", "ConnectionError", "OSError"], "[Errno 104] Connection reset by peer"),
    (["RuntimeError"], "CUDA error: an illegal memory access was encountered"),
    (["BrokenPipeError", "ConnectionError", "OSError"], "[Errno 32] Broken pipe"),
])
def test_user_exception_that_looks_like_a_network_error_does_not_poison_the_cache(
        tmp_path: Path, types: list[str], message: str) -> None:
    """Two supervised runs whose script raised such an exception; plain `python train.py`
    (resilient_strategy() with the same cache) still trains on the CPU."""
    facts = machine(0)
    for _ in range(2):
        for key in ("torch:cpu:cpu", NCCL):  # the last resort, and one that is not
            failure = _user_error_verdict(types, message, key)
            assert refusal(failure) is not None
            DecisionCache(tmp_path).store(facts.fingerprint(), {key: failure})
    assert DecisionCache(tmp_path).all_entries(facts.fingerprint()) == {}
    sel = simulate(facts, framework="torch", cache=True, cache_dir=tmp_path)
    assert sel.backend == "cpu"


def test_a_poisoned_file_of_an_older_version_is_ignored(tmp_path: Path) -> None:
    facts = machine(0)
    cache = DecisionCache(tmp_path)
    bad = _midrun("torch:cpu:cpu")
    blob = {"version": 1, "fingerprint": facts.fingerprint(),
            "results": {bad.candidate: {"at": 1e12, "seen": 5, "result": bad.to_dict()}}}
    tmp_path.chmod(0o700)
    cache.path(facts.fingerprint()).write_text(json.dumps(blob))
    assert cache.entries(facts.fingerprint(), now=1e12) == {}
    assert set(cache.all_entries(facts.fingerprint())) == {"torch:cpu:cpu"}  # shown, ignored
    assert simulate(facts, framework="torch", cache=True, cache_dir=tmp_path).backend == "cpu"


def test_a_full_temp_directory_names_itself(tmp_path: Path) -> None:
    hang = ProbeResult("torch:gloo:cpu", "timeout", 30.0, "timeout", "ranks [1] did not finish")
    short = space_short(hang, "/tmp", free=4096)
    assert short.cause == "no_space" and refusal(short) is not None
    assert space_short(hang, "/tmp", free=LOW_SPACE_BYTES) == hang
    assert space_short(ProbeResult("x", "ok"), "/tmp", free=0).ok
