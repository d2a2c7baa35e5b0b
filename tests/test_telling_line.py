"""Where no signature places a failure, the failing process's own most telling line is quoted,
verbatim and short, in the FALLBACK line, the verdict's line and explain() (issue 45, item 4):
NCCL's WARN first, else a traceback's last line, else the last line naming an error; a rank
killed by a signal is named by its signal. Pure: strings in, strings out."""

from __future__ import annotations

import logging

import pytest

from resilient_strategy.core.measures.probe import TELLING_CHARS, names_the_error, telling_line
from resilient_strategy.run.verdicts import RankExit, classify_attempt
from resilient_strategy.testing import machine, simulate

NCCL = """host:1:1 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>
host:1:1 [0] misc/socket.cc:484 NCCL WARN socket.c:540 Net : Connect to 10.0.0.2<45313> failed : No route to host
host:1:1 [0] NCCL WARN bootstrap.cc:88 -> 2
Traceback (most recent call last):
  File "train.py", line 9, in <module>
torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error
"""
TRACEBACK = """2026-11-25 18:00:00.123: W tensorflow/core/foo.cc:12] a banner, never the reason
Traceback (most recent call last):
  File "train.py", line 3, in <module>
    sensors.read()
frobnicate.FrobError: the frobnicator jammed at 0x7f (code 17)
"""
ODD = "FrobError: the frobnicator jammed at 0x7f (code 17)"


def test_the_telling_line_is_ncclss_warn_then_the_exception_then_an_error_line() -> None:
    assert telling_line(NCCL) == ("NCCL WARN socket.c:540 Net : Connect to 10.0.0.2<45313> "
                                  "failed : No route to host")
    assert telling_line(TRACEBACK) == f"frobnicate.{ODD}"
    assert telling_line("loading\nstep 3 failed to converge\nbye") == "step 3 failed to converge"
    assert telling_line("just\nsome output") == "some output"
    assert telling_line("  \n") == ""
    long = "ValueError: " + "word " * 60
    got = telling_line(long)
    assert len(got) <= TELLING_CHARS and got.endswith("...") and got.startswith("ValueError: ")
    assert names_the_error(telling_line(NCCL)) and names_the_error(telling_line(TRACEBACK))
    assert not names_the_error("some output")


def test_a_fallback_no_signature_explains_quotes_the_line(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "resilient_strategy")
    facts = machine(2)
    env = {**facts.env_map, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    sel = simulate(facts, {"*": f"fails:{TRACEBACK}"}, framework="torch",
                   global_batch_size=256, env=env, gradient_bytes=100 << 20,
                   sample_seconds=0.01)
    [line] = [r.getMessage() for r in caplog.records if "FALLBACK" in r.getMessage()]
    assert f'"frobnicate.{ODD}"' in line and "\n" not in line
    assert "worker_error" not in line
    lost = sel.results["torch:nccl:0,1"]  # type: ignore[attr-defined]
    assert dict(lost.extra)["unplaced"] == f"frobnicate.{ODD}"
    assert f'"frobnicate.{ODD}"' in lost.why()  # what explain() says of the probe
    said = sel.explain(verbose=True)  # type: ignore[attr-defined]
    assert f'"frobnicate.{ODD}"' in said and "a banner" not in said
    short = sel.explain()  # type: ignore[attr-defined]
    assert '"frobnicate.FrobError: the frobnicator jammed' in short


def test_a_placed_failure_keeps_its_cause_words_and_no_quote(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "resilient_strategy")
    facts = machine(2)
    env = {**facts.env_map, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    simulate(facts, {"*": "error:nccl_error"}, framework="torch", global_batch_size=256,
             env=env, gradient_bytes=100 << 20, sample_seconds=0.01)
    [line] = [r.getMessage() for r in caplog.records if "FALLBACK" in r.getMessage()]
    assert '"' not in line


def test_a_rank_that_died_without_an_exception_is_quoted_by_its_own_line() -> None:
    exited = RankExit(rank=1, exitcode=3, stderr_tail="step 40\nmyloader: shard 7 is corrupt\n")
    v = classify_attempt(None, [exited])
    assert '"myloader: shard 7 is corrupt"' in v.detail
    killed = RankExit(rank=0, exitcode=-11, stderr_tail="step 40\nloss 0.3\n")
    v = classify_attempt(None, [killed])
    assert "SIGSEGV" in v.summary and '"' not in v.summary  # a last line that names nothing
    warned = RankExit(rank=0, exitcode=-6, stderr_tail=NCCL)
    assert '"NCCL WARN socket.c:540' in warned.what() and "SIGABRT" in warned.what()
