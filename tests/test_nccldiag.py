"""NCCL's own diagnostics in the proof (core/nccldiag.py): the version gating (with fake
versions), the user's choices kept, the reports parsed, carried by a probe result and shown in
the trace. No process, no GPU.

The report samples are NCCL's documented formats: the "Diagnostics" page
(https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting/diagnostics.html:
the active P2P check's OK and partial lines, the net bandwidth lines with their ``host:pid``
prefix) and the "RAS Diagnostics" section of the RAS page
(https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting/ras.html: the
header, the five checks, a mismatch grouped by value, the completion line). NCCL 2.31 was not on
any machine this was built on (the H100 host has NCCL 2.28), so these are constructed from the
documentation, not recorded.
"""

from __future__ import annotations

import json

import pytest

from resilient_strategy.core.call.options import Options
from resilient_strategy.core.knowledge import nccldiag
from resilient_strategy.core.knowledge.rules import load_rules
from resilient_strategy.core.measures.probe import ProbeResult, ProbeSpec, parse_probe
from resilient_strategy.core.planning.plan import plan
from resilient_strategy.core.trace.ruling import NcclDiagnostics
from resilient_strategy.core.values.facts import Facts, FrameworkInfo, Gpu, Host, Link
from resilient_strategy.core.values.outcome import WorkerOutcome
from resilient_strategy.errors import InvalidRuleError

# the active diagnostics: rank 0's stdout, amid NCCL's INFO log and torch's own lines
ACTIVE_OK = """\
node-01:3873285:3873285 [0] NCCL INFO Initialized NET plugin IB
NCCL DIAG === NCCL Diagnostics ===
NCCL DIAG [OK]   p2p: verified P2P access in both directions between every GPU pair (56 peer accesses)
NCCL DIAG NCCL diagnostics completed in 245.3 ms across 8 ranks
"""
ACTIVE_PARTIAL = """\
NCCL DIAG === NCCL Diagnostics ===
NCCL DIAG [INFO] p2p: only 52/56 GPU-to-GPU peer accesses passed verification
NCCL DIAG NCCL diagnostics completed in 251.0 ms across 8 ranks
node0:24563 NCCL DIAG [OK] net bw: 376.1/391.5/398.2 Gbit/s min/median/max same-nic bw (across 8 ranks) in comm 0x7a3f9b2c41d05e88
"""
RAS_MISMATCH = """\
node042:12345 NCCL DIAG === RAS Diagnostics ===
node042:12345 NCCL DIAG [OK]   GPU inventory: 8x NVIDIA H100 per node consistent across 8 ranks in comm 0x1234
node042:12345 NCCL DIAG [OK]   CUDA driver version: 13000 consistent across 8 ranks in comm 0x1234
node042:12345 NCCL DIAG [OK]   ECC: no uncorrected volatile errors across 8 ranks in comm 0x1234
node042:12345 NCCL DIAG [OK]   NVLink: found 18 link(s) per device, all active across 8 ranks in comm 0x1234
node042:12345 NCCL DIAG [INFO] NCCL environment: mismatch across 8 ranks in comm 0x1234 for NCCL_DEBUG
node042:12345 NCCL DIAG [INFO] NCCL environment: NCCL_DEBUG=INFO on rank(s) {0,1,2,3}
node042:12345 NCCL DIAG [INFO] NCCL environment: NCCL_DEBUG=WARN on rank(s) {4,5,6,7}
node042:12345 NCCL DIAG RAS diagnostics completed in 12.3 ms across 8 RAS peers
"""


# ----- the version gating and the user's choices ---------------------------------------------
@pytest.mark.parametrize(("version", "expected"), [
    ((2, 21, 5), ()),  # before lazy connections: nothing to change
    ((2, 22, 3), (("NCCL_RUNTIME_CONNECT", "0"),)),
    ((2, 28, 9), (("NCCL_RUNTIME_CONNECT", "0"),)),  # the H100 host: no diagnostics yet
    ("2.28.9+cuda12.9", (("NCCL_RUNTIME_CONNECT", "0"),)),  # as facts carry it
    ((2, 28, 9, "rc1"), (("NCCL_RUNTIME_CONNECT", "0"),)),  # torch adds NCCL's suffix
    ((2, 31, 2), (("NCCL_RUNTIME_CONNECT", "0"), ("NCCL_RUN_DIAGNOSTICS", "1"),
                  ("NCCL_RUN_RAS_DIAGNOSTICS", "1"))),
    (23103, (("NCCL_RUNTIME_CONNECT", "0"), ("NCCL_RUN_DIAGNOSTICS", "1"),
             ("NCCL_RUN_RAS_DIAGNOSTICS", "1"))),  # ncclGetVersion's integer
    ((3, 0, 0), (("NCCL_RUNTIME_CONNECT", "0"), ("NCCL_RUN_DIAGNOSTICS", "1"),
                 ("NCCL_RUN_RAS_DIAGNOSTICS", "1"))),
    (None, ()), ("unknown", ()),  # a version we cannot read: nothing set
])
def test_each_variable_is_set_only_where_the_nccl_in_use_reads_it(
        version: object, expected: tuple[tuple[str, str], ...]) -> None:
    chosen = nccldiag.diagnostic_env(version, {})
    assert chosen.set == expected
    assert chosen.kept == ()


def test_the_users_own_choices_win() -> None:
    env = {"NCCL_RUNTIME_CONNECT": "1", "NCCL_RUN_DIAGNOSTICS": "0", "PATH": "/bin"}
    chosen = nccldiag.diagnostic_env((2, 31, 2), env)
    assert chosen.set == (("NCCL_RUN_RAS_DIAGNOSTICS", "1"),)
    assert chosen.kept == ("NCCL_RUNTIME_CONNECT", "NCCL_RUN_DIAGNOSTICS")


def test_the_shipped_table_cites_nccls_documents() -> None:
    table = nccldiag.builtin_table()
    assert {v.name for v in table} == {
        "NCCL_RUNTIME_CONNECT", "NCCL_RUN_DIAGNOSTICS", "NCCL_RUN_RAS_DIAGNOSTICS"}
    assert all(v.source.startswith("https://docs.nvidia.com/deeplearning/nccl/") for v in table)
    assert {v.name: v.since for v in table} == {
        "NCCL_RUNTIME_CONNECT": (2, 22), "NCCL_RUN_DIAGNOSTICS": (2, 31),
        "NCCL_RUN_RAS_DIAGNOSTICS": (2, 31)}


@pytest.mark.parametrize("text", [
    'version = 1\n[[variable]]\nname = "NCCL_X"\nvalue = "1"\nsince = "two"\nwhy = "w"\n'
    'source = "s"\n',
    'version = 1\n[[variable]]\nname = "LD_PRELOAD"\nvalue = "x"\nsince = "2.1"\nwhy = "w"\n'
    'source = "s"\n',
    'version = 1\n[[variable]]\nname = "NCCL_X"\nvalue = "1"\nsince = "2.1"\nwhy = "w"\n',
])
def test_a_malformed_table_is_refused(text: str) -> None:
    with pytest.raises(InvalidRuleError):
        nccldiag.parse_table(text, "mine.toml")


# ----- the reports ---------------------------------------------------------------------------
def test_a_clean_active_report() -> None:
    report = nccldiag.parse_report(nccldiag.report_lines(ACTIVE_OK))
    assert report.findings == (nccldiag.Finding(
        "NCCL", True, "p2p",
        "verified P2P access in both directions between every GPU pair (56 peer accesses)"),)
    assert report.completed == (nccldiag.Completed("NCCL", 245.3, 8),)
    assert report.issues == ()


def test_a_partial_p2p_check_is_an_issue_and_host_prefixes_are_read() -> None:
    report = nccldiag.parse_report(nccldiag.report_lines(ACTIVE_PARTIAL))
    assert [(f.report, f.ok, f.check) for f in report.findings] == [
        ("NCCL", False, "p2p"), ("NCCL", True, "net bw")]
    assert report.issues[0].text == "only 52/56 GPU-to-GPU peer accesses passed verification"


def test_a_ras_report_groups_a_mismatch_by_value() -> None:
    report = nccldiag.parse_report(nccldiag.report_lines(RAS_MISMATCH))
    assert {f.report for f in report.findings} == {"RAS"}
    assert [f.check for f in report.findings if f.ok] == [
        "GPU inventory", "CUDA driver version", "ECC", "NVLink"]
    assert [f.text for f in report.issues] == [
        "mismatch across 8 ranks in comm 0x1234 for NCCL_DEBUG",
        "NCCL_DEBUG=INFO on rank(s) {0,1,2,3}", "NCCL_DEBUG=WARN on rank(s) {4,5,6,7}"]
    assert report.completed == (nccldiag.Completed("RAS", 12.3, 8),)


def test_lines_without_the_mark_or_of_no_documented_form_are_skipped() -> None:
    text = "NCCL INFO Using network IB\nNCCL DIAG something new\nrandom [OK] p2p: no\n"
    assert nccldiag.report_lines(text) == ("something new",)
    assert nccldiag.parse_report(nccldiag.report_lines(text)).findings == ()
    assert len(nccldiag.report_lines("NCCL DIAG [OK] p2p: x\n" * 100)) == nccldiag.MAX_LINES


# ----- through the probe result into the trace -----------------------------------------------
SPEC = ProbeSpec("torch:nccl:0,1", "torch", "nccl", (0, 1), world_size=2)


def _ok_report(**more: object) -> str:
    return json.dumps({"status": "ok", "detail": "d", "bus_bandwidth_gbps": 100.0,
                       "message_bytes": 1 << 24, **more})


def _probe(stdout: str, diag: dict[str, object], status: str = "ok") -> ProbeResult:
    rank0 = _ok_report(nccl_diagnostics=diag,
                       rendezvous={"store": "TCPStore", "libuv": True}) if status == "ok" \
        else json.dumps({"status": "wrong_result", "cause": "wrong_result", "error": "e"})
    outcomes = [WorkerOutcome(0, 0 if status == "ok" else 1, report=rank0, stdout=stdout),
                WorkerOutcome(1, 0, report=_ok_report())]
    return parse_probe(SPEC, outcomes, 3.0, False)


def test_the_result_carries_how_nccl_ran_and_its_report() -> None:
    res = _probe(ACTIVE_PARTIAL + RAS_MISMATCH, {
        "version": "2.31.2", "set": ["NCCL_RUNTIME_CONNECT=0", "NCCL_RUN_RAS_DIAGNOSTICS=1"],
        "kept": ["NCCL_RUN_DIAGNOSTICS"]})
    assert res.ok  # an [INFO] finding never fails a probe: the checked collectives passed
    extra = list(res.extra)
    assert ("rendezvous", "TCPStore libuv") in extra
    assert [v for k, v in extra if k == nccldiag.EXTRA_SET] == [
        "NCCL_RUNTIME_CONNECT=0", "NCCL_RUN_RAS_DIAGNOSTICS=1"]
    assert [v for k, v in extra if k == nccldiag.EXTRA_KEPT] == ["NCCL_RUN_DIAGNOSTICS"]
    report, _, _ = nccldiag.from_extra(res.extra)
    assert len(report.findings) == 9 and len(report.issues) == 4
    assert ProbeResult.from_dict(json.loads(json.dumps(res.to_dict()))) == res  # cacheable


def test_a_clean_report_never_rescues_a_wrong_value() -> None:
    res = _probe(ACTIVE_OK, {})
    assert res.ok
    bad = _probe(ACTIVE_OK, {}, status="wrong")
    assert (bad.ok, bad.cause) == (False, "wrong_result")
    assert nccldiag.from_extra(bad.extra)[0].issues == ()  # NCCL saw nothing; the probe did


def _facts() -> Facts:
    gpus = tuple(Gpu(i, "NVIDIA H100", (9, 0), 80 << 30, f"GPU-{i}") for i in range(2))
    return Facts(gpus=gpus, links=(Link(0, 1, "hostbridge", 18, "ok", "ok"),),
                 host=Host(shm_bytes=64 << 30),
                 frameworks=(FrameworkInfo("torch", "2.11.0", "torch", "13.0", "2.31.2"),))


def test_the_trace_shows_nccls_findings_and_the_choice_stays_the_proofs() -> None:
    policy = Options("torch", global_batch_size=64, world_size=2)
    res = _probe(ACTIVE_PARTIAL, {"set": ["NCCL_RUNTIME_CONNECT=0", "NCCL_RUN_DIAGNOSTICS=1"]})
    p = plan(_facts(), load_rules(), {SPEC.candidate: res}, policy)
    assert p.chosen is not None and p.chosen.key == SPEC.candidate  # proven: chosen
    (event,) = [e for e in p.events if isinstance(e, NcclDiagnostics)]
    assert event.candidate.key == SPEC.candidate and event.probe_ok
    assert event.set == ("NCCL_RUNTIME_CONNECT=0", "NCCL_RUN_DIAGNOSTICS=1")
    assert [(f.check, f.ok) for f in event.issues] == [("p2p", False)]
    as_json = event.to_dict()
    assert as_json["kind"] == "nccl_diagnostics" and as_json["findings"][0]["check"] == "p2p"
    assert event.text()  # shown in explain()


def test_the_trace_says_how_nccl_ran_where_it_printed_no_report() -> None:
    policy = Options("torch", global_batch_size=64, world_size=2)
    res = _probe("", {"set": ["NCCL_RUNTIME_CONNECT=0"]})  # NCCL 2.28: no diagnostics
    p = plan(_facts(), load_rules(), {SPEC.candidate: res}, policy)
    (event,) = [e for e in p.events if isinstance(e, NcclDiagnostics)]
    assert (event.set, event.findings) == (("NCCL_RUNTIME_CONNECT=0",), ())


def test_a_gloo_probe_adds_no_nccl_event() -> None:
    policy = Options("torch", global_batch_size=64, world_size=2)
    gloo = ProbeResult("torch:gloo:0,1", "ok", 2.0, extra=(("rendezvous", "TCPStore libuv"),))
    p = plan(_facts(), load_rules(), {"torch:gloo:0,1": gloo}, policy)
    assert not [e for e in p.events if isinstance(e, NcclDiagnostics)]
