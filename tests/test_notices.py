"""What a user sees: the fallback warning (through logging, rank 0), the progress line per probe,
the short-timeout diagnosis, sel.print() and the typed error of sel.device on TensorFlow."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import deadline

from resilient_strategy.core.measures.probe import OK, ProbeResult
from resilient_strategy.deciding.cache import DecisionCache
from resilient_strategy.deciding.notices import (
    ProgressLine,
    Startup,
    fallback_warning,
    short_timeout_warning,
    startup_floor,
)
from resilient_strategy.errors import InvalidOptionError, WrongFrameworkError
from resilient_strategy.testing import machine, simulate

ROOT = Path(__file__).parents[1]
TWO = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}


def _torch(outcomes: dict[str, str], rank: int = 0, **kw: object) -> object:
    facts = machine(2)
    env = {**facts.env_map, **TWO, "RANK": str(rank), "LOCAL_RANK": str(rank)}
    kw.setdefault("gradient_bytes", 100 << 20)
    kw.setdefault("sample_seconds", 0.01)
    return simulate(facts, outcomes, framework="torch", global_batch_size=256, env=env, **kw)


def _fallbacks(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "FALLBACK" in r.getMessage()]


def test_fallback_is_one_warning_on_rank_0(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "resilient_strategy")
    sel = _torch({"*": "error:nccl_error"})
    (rec,) = _fallbacks(caplog)
    assert rec.levelno == logging.WARNING and rec.name == "resilient_strategy"
    text = rec.getMessage()
    assert "NCCL on GPUs 0,1" in text and sel.candidate.label in text and "instead of 2" in text
    assert "\n" not in text
    caplog.clear()
    _torch({"*": "error:nccl_error"}, rank=1)  # the same decision, seen from rank 1: silent
    assert not _fallbacks(caplog)


def test_no_fallback_warning_when_the_best_works(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "resilient_strategy")
    sel = _torch({"nccl": "ok"})
    assert sel.backend == "nccl" and not _fallbacks(caplog)


def test_fallback_cost_compares_estimates() -> None:
    from resilient_strategy.core.call.options import Options

    sel = _torch({"nccl": "error:nccl_error", "nccl+*": "error:nccl_error", "gloo": "ok"},
                 gradient_bytes=400 << 20, sample_seconds=1e-3)
    assert sel.backend == "gloo"  # type: ignore[attr-defined]
    policy = Options(framework="torch", global_batch_size=256, gradient_bytes=400 << 20,
                    sample_seconds=1e-3, world_size=2)
    text = fallback_warning(sel.plan, sel.results, sel.facts,  # type: ignore[attr-defined]
                            policy, sel.candidate)  # type: ignore[attr-defined]
    assert text is not None and "NCCL on GPUs 0,1" in text and "throughput" in text
    assert "about the same" not in text


def test_fallback_warning_visible_without_logging_configured(tmp_path: Path) -> None:
    code = ("from resilient_strategy.testing import machine, simulate\n"
            "f = machine(2)\n"
            "simulate(f, {'*': 'error:nccl_error'}, framework='torch', global_batch_size=64,\n"
            "         env={**f.env_map, 'WORLD_SIZE': '2', 'RANK': '0', 'LOCAL_RANK': '0'})\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=deadline(60),
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src"),
                              "TMPDIR": str(tmp_path)},  # rank 0's agreement file: no rank 1
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert [ln for ln in out.stderr.splitlines() if "FALLBACK" in ln]


def test_progress_line_per_probe(capsys: pytest.CaptureFixture[str]) -> None:
    sel = _torch({"nccl": "timeout", "nccl+*": "error:nccl_error", "gloo": "ok:2.5"}, quiet=False)
    lines = capsys.readouterr().err.splitlines()
    probed = [ln for ln in lines if ln.startswith("resilient_strategy: probing ")]
    assert len(probed) == len(sel.results) == 3  # type: ignore[attr-defined]
    assert "timed out" in probed[0] and "(timeout)" in probed[0]
    assert "ok in" in probed[-1] and "2.5 GB/s" in probed[-1]


@pytest.mark.parametrize("quiet, env", [(True, {}), (None, {}), (None, {"RESILIENT_STRATEGY_QUIET": "1"})])
def test_progress_off_when_quiet_or_not_a_terminal(
        capsys: pytest.CaptureFixture[str], quiet: bool | None, env: dict[str, str]) -> None:
    facts = machine(2)
    simulate(facts, {"nccl": "ok"}, framework="torch", quiet=quiet,
             env={**facts.env_map, **TWO, **env})
    assert "probing" not in capsys.readouterr().err  # captured stderr is not a terminal


def test_progress_asked_through_the_environment(capsys: pytest.CaptureFixture[str]) -> None:
    facts = machine(2)
    simulate(facts, {"nccl": "ok"}, framework="torch",
             env={**facts.env_map, **TWO, "RESILIENT_STRATEGY_QUIET": "0"})
    assert "probing NCCL on GPUs 0,1" in capsys.readouterr().err


@pytest.mark.parametrize("var, value", [("RESILIENT_STRATEGY_PROBE", "sometimes"),
                                        ("RESILIENT_STRATEGY_QUIET", "maybe"),
                                        ("RESILIENT_STRATEGY_PREFER", "ncl")])
def test_a_bad_variable_is_named(var: str, value: str) -> None:
    facts = machine(2)
    with pytest.raises(InvalidOptionError) as err:
        simulate(facts, {}, framework="torch", env={**facts.env_map, var: value})
    assert var in str(err.value)


def test_progress_line_survives_a_closed_stream() -> None:
    stream = io.StringIO()
    stream.close()
    ProgressLine(stream).end(ProbeResult("torch:gloo:cpu", OK, 1.0))  # no exception


def test_startup_floor_is_measured_from_passing_probes(tmp_path: Path) -> None:
    facts = machine(2)
    cache = DecisionCache(tmp_path, 3600.0)
    key = "torch:gloo:0,1"
    cache.store(facts.fingerprint(), {key: ProbeResult(key, OK, 4.0)})
    assert startup_floor("torch", cache.load(facts.fingerprint())) == Startup(4.0, measured=True)
    assert startup_floor("tensorflow", {key: ProbeResult(key, OK, 4.0)}).measured is False
    assert short_timeout_warning(30.0, Startup(4.0, True), "torch") is None
    assert short_timeout_warning(2.0, Startup(4.0, True), "torch") is not None


def test_a_simulation_has_no_start_up_to_check(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "resilient_strategy")
    sel = _torch({"*": "timeout"}, timeout=0.5)
    assert "timeout_short" not in {r.cause for r in sel.results.values()}  # type: ignore[attr-defined]
    assert not any("is shorter than" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
@pytest.mark.torch
def test_a_real_probe_cut_before_it_starts_is_not_called_a_hang(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A 0.5 s timeout on a real gloo probe (its workers import torch first): warned about up
    front, reported as timeout_short, and kept out of the cache."""
    from resilient_strategy import resilient_strategy

    caplog.set_level(logging.WARNING, "resilient_strategy")
    env = {**os.environ, **TWO, "OMP_NUM_THREADS": "1"}
    env.pop("RESILIENT_STRATEGY_PROBE_FAULT", None)
    sel = resilient_strategy(framework="torch", timeout=0.5, env=env, cache_dir=tmp_path,
                             quiet=True)
    (res,) = sel.results.values()
    assert (res.status, res.cause) == ("timeout", "timeout_short")
    assert any("timeout=0.5 s is shorter" in r.getMessage() for r in caplog.records)
    facts_fp = sel.facts.fingerprint()
    assert DecisionCache(tmp_path, 3600.0).load(facts_fp) == {}


def test_print_on_rank_0_only(capsys: pytest.CaptureFixture[str]) -> None:
    _torch({"nccl": "ok"}).print("hello", 1)  # type: ignore[attr-defined]
    _torch({"nccl": "ok"}, rank=1).print("from rank 1")  # type: ignore[attr-defined]
    assert capsys.readouterr().out == "hello 1\n"


def test_device_on_a_tensorflow_selection_is_a_typed_error() -> None:
    facts = machine(2, torch=None, tensorflow="2.21.0", tf_cuda="12.5")
    sel = simulate(facts, {"nccl": "ok"}, framework="tensorflow", global_batch_size=64)
    with pytest.raises(WrongFrameworkError):
        _ = sel.device
    assert not hasattr(sel, "device")  # still an AttributeError for hasattr
