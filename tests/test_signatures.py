"""The signature table (core/knowledge/signatures.toml) as data: every entry sourced, the verbatim texts of
the field catalogue placed on their causes, the user's entries first, bad files refused with the
entry named; the probe parser and the supervisor's classifier read the same table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resilient_strategy.core.knowledge.causes import CAUSES
from resilient_strategy.core.knowledge.signatures import (
    KINDS,
    VERSION,
    builtin_signatures,
    load_signatures,
    parse_signatures,
    signatures_from_env,
)
from resilient_strategy.core.measures.probe import ERROR, ProbeSpec, parse_probe
from resilient_strategy.core.values.outcome import WorkerOutcome
from resilient_strategy.errors import InvalidRuleError
from resilient_strategy.run.verdicts import classify_error

SPEC = ProbeSpec("torch:nccl:0,1", "torch", "nccl", (0, 1), world_size=2, timeout_s=20.0)


def test_every_builtin_entry_is_sourced_known_and_unique() -> None:
    table = builtin_signatures()
    assert table.version == VERSION
    assert len(table.entries) >= 20
    assert all(e.source.startswith(("https://", "measured")) for e in table.entries)
    assert {e.cause for e in table.entries} <= set(CAUSES)
    assert {e.kind for e in table.entries} <= set(KINDS)
    assert len({e.id for e in table.entries}) == len(table.entries)


# Verbatim from public reports (each a field case's source, or a signature's).
@pytest.mark.parametrize(("text", "cause"), [
    # pytorch/pytorch#177472: NVLS bind failure wrapped in ncclUnhandledCudaError
    ("ncclUnhandledCudaError: Call to CUDA function failed. \nLast error: \nFailed to bind "
     "NVLink SHARP (NVLS) Multicast memory of size 2097152 : CUDA error 401 'the operation "
     "cannot be performed in the present state'.", "nvls_multicast"),
    # NVIDIA/nccl#2077: the NVLS text quotes "out of memory", which is not GPU memory
    ("Failed to bind NVLink SHARP (NVLS) Multicast memory of size 2097152 : CUDA error 2 'out of "
     "memory'.", "nvls_multicast"),
    ("transport/nvls.cc:158 NCCL WARN Cuda failure 1 'invalid argument'", "nvls_multicast"),
    # NVIDIA/nccl#902, #1664: RDMA completion errors
    ("NCCL WARN NET/IB : Got completion with error 12, opcode 0, len 0, vendor err 129",
     "rdma_error"),
    ("NET/IBP:Got completion from peer 7.6.13.83<36315> with status=12 opcode=32698 len=32696 "
     "vendor err 129 (Send)", "rdma_error"),
    # tensorflow/tensorflow#51760
    ("ibvwrap.c:130 NCCL WARN Call to ibv_create_qp failed", "rdma_error"),
    # pytorch/gloo#223
    ("[gloo/gloo/transport/tcp/pair.cc:761] connect [127.0.1.1]:60817: Connection refused",
     "gloo_connection"),
    # Megvii-BaseDetection/YOLOX#139: GLOO_SOCKET_IFNAME names an interface this machine lacks
    # (not a loopback hostname: gloo_connection's words would send the user the wrong way)
    ("RuntimeError: [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
     "device.cc:84] ifa != nullptr. Unable to find address for: nonexist0", "gloo_interface"),
    # NVIDIA/nccl-tests#264: CUDA cannot initialise although nvidia-smi lists the GPUs
    ("test: Test CUDA failure common.cu:941 'system not yet initialized'", "cuda_init"),
    # ray-project/ray_lightning#24
    ("transport/p2p.cc:238 NCCL WARN failed to open CUDA IPC handle : 217 peer access is not "
     "supported between these two devices", "p2p_unsupported"),
    # pytorch/pytorch#139990
    ("RuntimeError: use_libuv was requested but PyTorch was build without libuv support",
     "store_libuv"),
    # NVIDIA/nccl#1837: a missing NCCL_SOCKET_IFNAME interface
    ("ncclInternalError: Internal check failed.\nLast error:\nncclSocketInit: connecting to "
     "address  with family 59936 is neither AF_INET(2) nor AF_INET6(10)", "nccl_network"),
    # NVIDIA/nccl#983 and msr-fiddle/pipedream#76
    ("Caught signal 7 (Bus error: nonexistent physical address)", "shared_memory"),
    # pytorch/pytorch#118369: a watchdog timeout is a hang
    ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=96120, "
     "OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 25624887 milliseconds before timing out.",
     "timeout"),
    ("ValueError: a user's own bug", "worker_error"),
])
def test_verbatim_reports_are_placed_on_their_causes(text: str, cause: str) -> None:
    assert builtin_signatures().classify(text) == cause


def test_a_signal_entry_places_a_worker_killed_by_that_signal() -> None:
    res = parse_probe(SPEC, [WorkerOutcome(0, -7, signal=7, failed_first=True),
                             WorkerOutcome(1, None, signal=15, killed_by_runner=True)], 1.0, False)
    assert (res.status, res.cause) == (ERROR, "shared_memory")


def test_text_no_entry_places_stays_worker_error_and_is_quoted() -> None:
    rep = json.dumps({"status": "error", "error": "KeyError: 'fc.weight' in my loader"})
    res = parse_probe(SPEC, [WorkerOutcome(0, 1, report=rep, failed_first=True)], 1.0, False)
    assert (res.cause, dict(res.extra)) == ("worker_error",
                                            {"unplaced": "KeyError: 'fc.weight' in my loader"})
    died = parse_probe(SPEC, [WorkerOutcome(0, 3, stderr="boom\nSomeError: odd thing")], 1.0,
                       False)
    assert (died.cause, dict(died.extra)) == ("worker_error", {"unplaced": "SomeError: odd thing"})
    placed = parse_probe(SPEC, [WorkerOutcome(0, 3, stderr="ncclSystemError: x")], 1.0, False)
    assert "unplaced" not in dict(placed.extra)


def _write(tmp_path: Path, body: str, name: str = "mine.toml") -> Path:
    path = tmp_path / name
    path.write_text(body, encoding="utf-8")
    return path


def test_user_entries_go_first_and_replace_a_builtin_id(tmp_path: Path) -> None:
    path = _write(tmp_path, """
version = 1
[[signature]]
id = "site-fabric-flap"
cause = "rdma_error"
kind = "nccl_warn"
match = 'our fabric flapped'
source = "https://wiki.example.org/incident/42"

[[signature]]
id = "torch-watchdog-timeout"
cause = "nccl_error"
kind = "torch"
match = 'Watchdog caught collective operation timeout'
source = "https://wiki.example.org/incident/43"
""")
    table = load_signatures([path])
    assert table.entries[0].id == "site-fabric-flap"
    assert table.classify("ncclSystemError: our fabric flapped") == "rdma_error"
    assert table.classify("Watchdog caught collective operation timeout") == "nccl_error"
    assert len(table.entries) == len(builtin_signatures().entries) + 1
    # the same table through the environment variable, for the probe parser and the classifier
    env_table = signatures_from_env({"RESILIENT_STRATEGY_SIGNATURES": str(path)}, ":")
    assert env_table.classify("our fabric flapped") == "rdma_error"
    rep = json.dumps({"status": "error", "error": "our fabric flapped"})
    res = parse_probe(SPEC, [WorkerOutcome(0, 1, report=rep)], 1.0, False, signatures=env_table)
    assert res.cause == "rdma_error"
    assert classify_error(["builtins.RuntimeError"], "our fabric flapped", env_table) == "comm"
    assert classify_error(["builtins.RuntimeError"], "our fabric flapped") == "user"


@pytest.mark.parametrize(("body", "words"), [
    ("version = 2\n", "version"),
    ("version = 1\n[[signature]]\nid = 'x'\ncause = 'nope'\nkind = 'cuda'\nmatch = 'a'\n"
     "source = 's'\n", "cause"),
    ("version = 1\n[[signature]]\nid = 'x'\ncause = 'oom'\nkind = 'cuda'\nmatch = '('\n"
     "source = 's'\n", "regular expression"),
    ("version = 1\n[[signature]]\nid = 'x'\ncause = 'oom'\nkind = 'cuda'\nmatch = 'a'\n",
     "source"),
    ("version = 1\n[[signature]]\nid = 'x'\ncause = 'oom'\nkind = 'cuda'\nsource = 's'\n",
     "exactly one of match"),
    ("version = 1\n[[signature]]\nid = 'x'\ncause = 'oom'\nkind = 'weird'\nmatch = 'a'\n"
     "source = 's'\n", "kind"),
    ("version = 1\n[[signature]]\nid = 'x'\ncause = 'oom'\nkind = 'cuda'\nmatch = 'a'\n"
     "source = 's'\nextra = 1\n", "unknown key"),
    ("not toml [", "TOML"),
])
def test_a_bad_signature_file_is_refused_naming_the_problem(body: str, words: str) -> None:
    with pytest.raises(InvalidRuleError) as info:
        parse_signatures(body, "mine.toml")
    assert words in str(info.value)


def test_an_unreadable_user_file_is_one_clean_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidRuleError):
        load_signatures([tmp_path / "missing.toml"])
    with pytest.raises(InvalidRuleError):
        load_signatures([tmp_path])  # a directory


def test_the_simulation_places_reported_text_through_the_table() -> None:
    from resilient_strategy.testing.simulation import SimulatedProber

    with pytest.raises(ValueError):
        SimulatedProber({"nccl": "fails:"})
    with pytest.raises(ValueError):
        SimulatedProber({"nccl": "signal:99"})
    prober = SimulatedProber({"nccl": "fails:transport/nvls.cc:254 NCCL WARN Cuda failure 401",
                              "gloo": "signal:7"})
    assert prober(SPEC, {}).cause == "nvls_multicast"
    gloo = ProbeSpec("torch:gloo:0,1", "torch", "gloo", (0, 1), world_size=2)
    assert prober(gloo, {}).cause == "shared_memory"


def test_mid_run_failures_are_judged_from_the_same_table() -> None:
    """Verbatim mid-run texts (the supervisor's side): a backend fault with the cause the
    planner's remedies key on."""
    from resilient_strategy.run.verdicts import RankExit, classify_attempt

    nvls = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, unhandled "
            "cuda error, NCCL version 2.29.7\nncclUnhandledCudaError: Call to CUDA function "
            "failed.\nFailed to bind NVLink SHARP (NVLS) Multicast memory of size 2097152 : CUDA "
            "error 2 'out of memory'.")  # NVIDIA/nccl#2077, during FSDP
    verdict = classify_attempt(None, [RankExit(0, 1, error={
        "types": ["torch.distributed.DistBackendError", "builtins.RuntimeError"],
        "message": nvls})])
    assert (verdict.kind.value, verdict.cause) == ("backend", "nvls_multicast")
    ib = ("NCCL WARN NET/IB : Got completion from peer 10.216.210.236<54862> with status=12 "
          "opcode=0 len=0 vendor err 129 (Recv)")  # NVIDIA/nccl#1405, mid-training
    verdict = classify_attempt(None, [RankExit(1, 1, error={
        "types": ["builtins.RuntimeError"], "message": "NCCL communicator was aborted"},
        stderr_tail=ib)])
    assert (verdict.kind.value, verdict.cause) == ("backend", "rdma_error")
    assert classify_error(["builtins.RuntimeError"],
                          "Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/"
                          "tcp/pair.cc:144] no error") == "comm"  # sgl-project/sglang#3226
    assert classify_error(["builtins.RuntimeError"], "mat1 and mat2 shapes cannot be "
                          "multiplied") == "user"


def test_an_unplaced_failure_says_so_in_its_words() -> None:
    rep = json.dumps({"status": "error", "error": "KeyError: 'fc.weight'"})
    res = parse_probe(SPEC, [WorkerOutcome(0, 1, report=rep, failed_first=True)], 1.0, False)
    assert dict(res.extra)["unplaced"] in res.why()
