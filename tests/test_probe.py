"""parse_probe and classify, from strings: no process is started here."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient_strategy.core.measures.probe import (
    CAUSES,
    ERROR,
    OK,
    TIMEOUT,
    ProbeResult,
    ProbeSpec,
    WorkerOutcome,
    classify,
    parse_probe,
    phase_times,
    tail,
)

SPEC = ProbeSpec("torch:nccl:0,1", "torch", "nccl", (0, 1), world_size=2, timeout_s=20.0)


def ok_report(gbps: float = 100.0, step: float = 0.01) -> str:
    return json.dumps({"status": "ok", "bus_bandwidth_gbps": gbps, "message_bytes": 1 << 24,
                       "step_seconds": step, "detail": "nccl x2"})


@pytest.mark.parametrize(("text", "cause"), [
    ("torch.distributed.DistBackendError: NCCL error in: ... invalid usage (run with "
     "NCCL_DEBUG=WARN for details), NCCL version 2.28.9\nncclInvalidUsage", "nccl_invalid_usage"),
    ("Error while creating shared memory segment /dev/shm/nccl-abc (size 9637888)", "shared_memory"),
    ("NCCL WARN Call to posix_fallocate failed : No space left on device", "shared_memory"),
    ("CollectiveReduceV2: Error invoking NCCL: unhandled cuda error", "cuda_error"),
    ("NVIDIA GeForce RTX 5090 with CUDA capability sm_120 is not compatible with the current "
     "PyTorch installation.", "no_kernel_image"),
    ("CUDA error: no kernel image is available for execution on the device", "no_kernel_image"),
    ("RuntimeError: Distributed package doesn't have NCCL built in", "backend_unavailable"),
    ("InvalidArgumentError: No OpKernel was registered to support Op 'NcclAllReduce'",
     "backend_unavailable"),
    ("ncclSystemError: System call (e.g. socket, malloc) or external library call failed",
     "nccl_error"),
    # NCCL 2.28.9 on an H100 (two simulated nodes sharing GPU 0): ncclInvalidUsage, yet no
    # NCCL_* variable is wrong
    ("DistBackendError: NCCL error in: NCCLUtils.cpp:93, invalid usage (run with "
     "NCCL_DEBUG=WARN for details), NCCL version 2.28.9\nncclInvalidUsage: This usually "
     "reflects invalid usage of NCCL library.\nLast error:\nDuplicate GPU detected : rank 0 "
     "and rank 1 both on CUDA device 60", "nccl_duplicate_gpu"),
    ("ValueError: something unrelated", "worker_error"),
    ("", "worker_error"),
    # a busy or too-small GPU is not broken P2P (cuda_error would turn P2P off)
    ("RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
     "reported", "oom"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "oom"),
    ("ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 2 "
     "'out of memory'", "oom"),
    ("ResourceExhaustedError: OOM when allocating tensor with shape[4096,4096]", "oom"),
    # NCCL's own wording of a failed segment, also inside an ncclSystemError
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3690\n"
     "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or "
     "device error.\nLast error:\nError while creating shared memory segment "
     "/dev/shm/nccl-Q2nK (size 9637888)", "shared_memory"),
    ("ncclSystemError ... Last error:\nError while attaching to shared memory segment "
     "/dev/shm/nccl-x (size 0), error: No such file or directory (2)", "shared_memory"),
    ("NCCL WARN shm_open failed to open /nccl-shm-3", "shared_memory"),
    # a hint that merely mentions /dev/shm does not make the failure a shared-memory one
    ("ncclUnhandledCudaError: unhandled cuda error (hint: if /dev/shm is small, set "
     "NCCL_SHM_DISABLE=1)", "cuda_error"),
    ("ValueError: bad shape; note: the dataset cache lives in /dev/shm/data", "worker_error"),
])
def test_classify(text: str, cause: str) -> None:
    assert classify(text) == cause
    assert cause in CAUSES


def test_tail_is_bounded() -> None:
    text = "\n".join(f"line {i}" for i in range(1000))
    assert tail(text, 3) == "line 997\nline 998\nline 999"
    assert len(tail("x" * 10_000, chars=100)) == 100


def test_all_ranks_ok_gives_the_slowest_figures() -> None:
    res = parse_probe(SPEC, [WorkerOutcome(0, 0, report=ok_report(120.0, 0.010)),
                             WorkerOutcome(1, 0, report=ok_report(100.0, 0.012))], 3.21, False)
    assert (res.status, res.cause, res.ranks) == (OK, "", 2)
    assert res.bus_bandwidth_gbps == 100.0
    assert res.step_seconds == 0.012
    assert res.message_bytes == 1 << 24
    assert res.elapsed_s == 3.21
    assert res.ok


def test_reported_cause_wins_over_classification() -> None:
    rep = json.dumps({"status": "error", "error": "torch 2.13.0+cpu was built without NCCL",
                      "cause": "backend_unavailable"})
    res = parse_probe(SPEC, [WorkerOutcome(0, 1, report=rep), WorkerOutcome(1, 1, report=rep)],
                      1.5, False)
    assert (res.status, res.cause) == (ERROR, "backend_unavailable")
    assert res.detail == "rank 0: torch 2.13.0+cpu was built without NCCL"


def test_reported_error_is_classified_from_its_text() -> None:
    rep = json.dumps({"status": "error", "error": "DistBackendError: NCCL error: invalid usage"})
    res = parse_probe(SPEC, [WorkerOutcome(0, 1, report=rep),
                             WorkerOutcome(1, None, signal=15, killed_by_runner=True)], 2.0, False)
    assert (res.status, res.cause) == (ERROR, "nccl_invalid_usage")


# As a torch 2.11 / NCCL 2.28.9 rank reported it on 2x H200 with NCCL_ALGO=bogus.
NCCL_BOGUS = (
    "DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, "
    "invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.28.9\n"
    "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
    "Last error:\n"
    'Unrecognized element token "bogus" when parsing "bogus"\n'
    "Traceback (most recent call last):\n  ...\n"
)


def test_nccl_last_error_names_the_culprit() -> None:
    rep = json.dumps({"status": "error", "error": NCCL_BOGUS})
    res = parse_probe(SPEC, [WorkerOutcome(0, 1, report=rep, failed_first=True),
                             WorkerOutcome(1, None, signal=15, killed_by_runner=True)], 3.9, False)
    assert (res.status, res.cause) == (ERROR, "nccl_invalid_usage")
    assert res.detail.startswith("rank 0: DistBackendError: NCCL error in:")
    assert res.detail.endswith('[NCCL: Unrecognized element token "bogus" when parsing "bogus"]')


def test_the_rank_that_failed_first_is_blamed_not_its_echo() -> None:
    echo = json.dumps({"status": "error", "error": "RuntimeError: Connection reset by peer"})
    res = parse_probe(SPEC, [
        WorkerOutcome(0, 1, report=echo),
        WorkerOutcome(1, 1, stderr="Traceback...\nncclInvalidUsage: bad NCCL_ALGO", failed_first=True),
    ], 1.0, False)
    assert (res.status, res.cause) == (ERROR, "nccl_invalid_usage")
    assert res.detail.startswith("rank 1 exited with code 1")


def test_wrong_result_on_any_rank() -> None:
    wrong = json.dumps({"status": "wrong_result", "error": "index 512: 4025.0 instead of 4024.0"})
    res = parse_probe(SPEC, [WorkerOutcome(0, 0, report=ok_report()),
                             WorkerOutcome(1, 1, report=wrong)], 1.0, False)
    assert (res.status, res.cause) == (ERROR, "wrong_result")
    assert "4025.0" in res.detail


def test_a_signal_death_is_a_crash() -> None:
    res = parse_probe(SPEC, [WorkerOutcome(0, None, signal=11, failed_first=True),
                             WorkerOutcome(1, None, signal=15, killed_by_runner=True)], 1.0, False)
    assert (res.status, res.cause) == (ERROR, "crash")
    assert "signal 11" in res.detail


def test_deadline_without_reports_is_a_timeout() -> None:
    res = parse_probe(SPEC, [WorkerOutcome(0, None, signal=15, killed_by_runner=True),
                             WorkerOutcome(1, None, signal=15, killed_by_runner=True,
                                           stderr="RESILIENT_STRATEGY_PROBE_FAULT: rank 1 hangs")],
                      20.0, True)
    assert (res.status, res.cause) == (TIMEOUT, "timeout")
    assert "[0, 1]" in res.detail
    assert "rank 1 hangs" in res.stderr_tail


def test_clean_exit_without_report_is_an_error() -> None:
    res = parse_probe(SPEC, [WorkerOutcome(0, 0, report=ok_report()), WorkerOutcome(1, 0)],
                      1.0, False)
    assert (res.status, res.cause) == (ERROR, "worker_error")
    assert "[1]" in res.detail


def test_unreadable_report() -> None:
    res = parse_probe(SPEC, [WorkerOutcome(0, 0, report="{not json")], 1.0, False)
    assert res.status == ERROR
    assert "unreadable report" in res.detail


def test_no_outcomes_is_not_ok() -> None:
    assert parse_probe(SPEC, [], 0.0, False).status == ERROR


def test_result_round_trips_through_a_dict() -> None:
    res = ProbeResult("c", OK, 1.0, bus_bandwidth_gbps=3.8, extra=(("k", "v"),))
    assert ProbeResult.from_dict(json.loads(json.dumps(res.to_dict()))) == res
    assert ProbeResult.from_dict({"candidate": "c", "status": "ok", "future_field": 1}) == \
        ProbeResult("c", OK)  # a newer writer's extra keys are ignored


@pytest.mark.parametrize("change", [
    {"bus_bandwidth_gbps": "fast"},
    {"bus_bandwidth_gbps": float("nan")},
    {"bus_bandwidth_gbps": float("inf")},
    {"step_seconds": -1.0},
    {"elapsed_s": None},
    {"elapsed_s": True},
    {"status": "weird"},
    {"cause": "not_a_cause"},
    {"cause": None},
    {"candidate": 3},
    {"detail": ["a"]},
    {"ranks": 1.5},
    {"message_bytes": "16M"},
    {"extra": [["k"]]},
    {"extra": "k=v"},
])
def test_from_dict_rejects_invalid_data(change: dict[str, object]) -> None:
    good = ProbeResult("c", ERROR, 1.0, "timeout", bus_bandwidth_gbps=3.8, step_seconds=0.1,
                       message_bytes=1 << 24).to_dict()
    ProbeResult.from_dict(good)
    with pytest.raises(ValueError):
        ProbeResult.from_dict({**good, **change})


@pytest.mark.parametrize("data", [{"status": "ok"}, {"candidate": "c"}, [], "c", None])
def test_from_dict_rejects_what_is_not_a_result(data: object) -> None:
    with pytest.raises(ValueError):
        ProbeResult.from_dict(data)  # type: ignore[arg-type]


def test_an_unknown_reported_cause_is_classified_and_non_finite_figures_are_dropped() -> None:
    bad = json.dumps({"status": "error", "cause": "mystery", "error": "CUDA error: out of memory"})
    res = parse_probe(SPEC, [WorkerOutcome(0, 1, report=bad, failed_first=True),
                             WorkerOutcome(1, None, killed_by_runner=True)], 1.0, False)
    assert res.cause == "oom"
    odd = json.dumps({"status": "ok", "bus_bandwidth_gbps": float("nan"), "step_seconds": "x",
                      "message_bytes": "16M"})
    res = parse_probe(SPEC, [WorkerOutcome(0, 0, report=odd), WorkerOutcome(1, 0, report=odd)],
                      1.0, False)
    assert res.ok and (res.bus_bandwidth_gbps, res.step_seconds, res.message_bytes) == (None,) * 3
    assert ProbeResult.from_dict(json.loads(json.dumps(res.to_dict()))) == res


_outcomes = st.lists(
    st.builds(
        WorkerOutcome,
        rank=st.integers(0, 7),
        returncode=st.one_of(st.none(), st.integers(0, 3)),
        signal=st.one_of(st.none(), st.sampled_from([9, 11, 15])),
        report=st.one_of(st.text(max_size=40), st.sampled_from([ok_report(), '{"status": "error"}',
                                                                '{"status": "wrong_result"}', "[]"])),
        stderr=st.text(max_size=80),
        killed_by_runner=st.booleans(),
        failed_first=st.booleans(),
    ),
    max_size=4,
)


@settings(deadline=None)  # a busy machine must not make timing flaky
@given(_outcomes, st.booleans())
def test_parse_never_raises_and_ok_means_every_rank_ok(
    outcomes: list[WorkerOutcome], timed_out: bool
) -> None:
    res = parse_probe(SPEC, outcomes, 1.0, timed_out)
    assert res.status in (OK, ERROR, TIMEOUT)
    if res.ok:
        assert outcomes and not timed_out
        assert all(o.report == ok_report() for o in outcomes)


def test_fault_injection_can_target_one_backend() -> None:
    from resilient_strategy.probing.workers.common import fault_for

    env = {"RESILIENT_STRATEGY_PROBE_FAULT": "hang:1:nccl"}
    assert fault_for(1, env, "nccl") == "hang"
    assert fault_for(1, env, "gloo") == ""
    assert fault_for(0, env, "nccl") == ""
    assert fault_for(1, {"RESILIENT_STRATEGY_PROBE_FAULT": "exit:1"}, "gloo") == "exit"
    assert fault_for(1, {"RESILIENT_STRATEGY_PROBE_FAULT": "melt:1"}, "gloo") == ""


def test_fault_injection_can_target_plain_nccl_or_large_messages() -> None:
    from resilient_strategy.probing.workers.common import corrupts, fault_for

    plain = {"RESILIENT_STRATEGY_PROBE_FAULT": "hang:1:nccl:plain"}
    assert fault_for(1, plain, "nccl") == "hang"
    assert fault_for(1, {**plain, "NCCL_P2P_DISABLE": "1"}, "nccl") == ""  # a remedy works
    assert fault_for(1, {**plain, "NCCL_SHM_DISABLE": "1"}, "nccl") == ""
    large = {"RESILIENT_STRATEGY_PROBE_FAULT": "wrong:1:nccl:>=33554432"}
    kind = fault_for(1, large, "nccl")
    assert kind == "wrong"
    assert not corrupts(kind, large, 4 << 10)
    assert corrupts(kind, large, 32 << 20) and corrupts(kind, large, 64 << 20)
    anywhere = {"RESILIENT_STRATEGY_PROBE_FAULT": "wrong:1"}
    assert corrupts(fault_for(1, anywhere, "gloo"), anywhere, 4)
    assert not corrupts("hang", plain, 64 << 20)
    for bad in ("hang:1:nccl:somewhere", "wrong:1:nccl:>=x", "hang:1:nccl:plain:extra"):
        assert fault_for(1, {"RESILIENT_STRATEGY_PROBE_FAULT": bad}, "nccl") == ""



def test_a_rendezvous_store_without_libuv_is_the_cause_the_plan_remedies() -> None:
    # the probe's store is a libuv TCPStore wherever torch's rendezvous makes one: a build
    # without libuv now fails the probe as it fails training, with USE_LIBUV=0 as the remedy
    err = ("RuntimeError: use_libuv was requested but PyTorch was build without libuv support, "
           "run with USE_LIBUV=0 to disable it.")
    outcomes = [WorkerOutcome(0, 1, report=json.dumps({"status": "error", "error": err})),
                WorkerOutcome(1, None, killed_by_runner=True)]
    res = parse_probe(SPEC, outcomes, 1.0, False)
    assert (res.status, res.cause) == (ERROR, "store_libuv")


def test_new_torch_faults_target_their_collective() -> None:
    from resilient_strategy.probing.workers.common import HANGS, fault_for

    for kind in ("hang_rendezvous", "hang_broadcast", "hang_gather", "wrong_broadcast",
                 "wrong_gather"):
        assert fault_for(1, {"RESILIENT_STRATEGY_PROBE_FAULT": f"{kind}:1:gloo"}, "gloo") == kind
    assert {"hang_rendezvous", "hang_broadcast", "hang_gather"} <= set(HANGS)


def test_the_earliest_reported_failure_is_blamed_when_the_runner_saw_the_echo_exit_first() -> None:
    # zero:0: rank 0 found zeros and left; rank 1, in the next all-reduce, got "connection
    # reset" and happened to be polled as exited before rank 0 (the runner's pick)
    cause = json.dumps({"status": "wrong_result", "cause": "zero_result", "failed_at": 100.0,
                        "error": "zero_result: 3 zero(s) in the all-reduce"})
    echo = json.dumps({"status": "error", "failed_at": 100.2,
                       "error": "RuntimeError: Connection reset by peer"})
    res = parse_probe(SPEC, [WorkerOutcome(0, 1, report=cause),
                             WorkerOutcome(1, 1, report=echo, failed_first=True)], 1.0, False)
    assert (res.status, res.cause) == (ERROR, "zero_result")
    assert res.detail.startswith("rank 0")


def test_without_failure_times_the_runners_pick_stands() -> None:
    first = json.dumps({"status": "error", "error": "RuntimeError: ncclInvalidUsage"})
    other = json.dumps({"status": "wrong_result", "cause": "nan_result", "error": "nan"})
    res = parse_probe(SPEC, [WorkerOutcome(0, 1, report=other),
                             WorkerOutcome(1, 1, report=first, failed_first=True)], 1.0, False)
    assert res.cause == "nccl_invalid_usage" and res.detail.startswith("rank 1")


def test_a_framework_log_banner_is_never_the_cause_of_a_worker_that_died() -> None:
    banner = ("2026-11-25 18:00:00.123456: I tensorflow/core/util/port.cc:153] oneDNN custom "
              "operations are on. You may see slightly different numerical results due to "
              "floating-point round-off errors from different computation orders.")
    seen = ("I0000 00:00:1795632271.642737   12217 port.cc:153] oneDNN custom operations are "
            "on. You may see slightly different numerical results due to floating-point "
            "round-off errors from different computation orders.")  # TF 2.21, as it printed it
    for stderr in (f"ValueError: no devices\n{banner}", f"ValueError: no devices\n{seen}",
                   f"Traceback (most recent call last):\nRuntimeError: collective failed\n{banner}\n"
                   "W0000 00:00:1732550000.1 123 warn.cc:1] a warning about errors"):
        res = parse_probe(SPEC, [WorkerOutcome(0, 1, stderr=stderr, failed_first=True)], 1.0,
                          False)
        assert "oneDNN" not in res.detail and "warning" not in res.detail
        assert res.detail.split(": ", 1)[1].split(":")[0] in ("ValueError", "RuntimeError")


def test_phase_times_are_the_slowest_ranks_in_order_and_bad_marks_are_left_out() -> None:
    start = 1000.0

    def outcome(rank: int, marks: object) -> WorkerOutcome:
        return WorkerOutcome(rank, 0, report=json.dumps({"status": "ok", "phase_at": marks}))

    outcomes = (
        outcome(0, {"started": 1000.5, "imported": 1002.0, "comm_ready": 1002.25}),
        outcome(1, {"started": 1000.25, "imported": 1003.0, "comm_ready": 1003.5,
                    "bogus": "x", "before": 999.0, "nan": float("nan")}),
        WorkerOutcome(2, None, report=""),  # killed: no report
        WorkerOutcome(3, 1, report="{not json"),
    )
    assert phase_times(outcomes, start) == (("started", 0.5), ("imported", 3.0),
                                            ("comm_ready", 3.5))
    assert phase_times((), start) == ()


def test_phases_survive_the_round_trip_and_bad_ones_are_refused() -> None:
    res = ProbeResult("torch:gloo:cpu", OK, elapsed_s=2.0, phases=(("imported", 1.5),))
    assert ProbeResult.from_dict(json.loads(json.dumps(res.to_dict()))) == res
    for bad in ([["imported"]], [["imported", -1.0]], [[1, 2.0]], "imported", [["x", True]]):
        with pytest.raises(ValueError):
            ProbeResult.from_dict({**res.to_dict(), "phases": bad})
