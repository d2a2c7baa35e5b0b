"""One line for every bad input (issue 22.5): every RESILIENT_STRATEGY_* variable and every
--simulate file ends in a ResilientStrategyError naming what was typed, never a raw traceback.
Regressions first, then two fuzzers with a fixed budget."""

from __future__ import annotations

import copy
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient_strategy.cli import main, simulate_file
from resilient_strategy.core.call.arguments import Arguments, options_from, run_options_from
from resilient_strategy.errors import ResilientStrategyError
from resilient_strategy.records import handoff
from resilient_strategy.records.trainfault import parse_fault
from resilient_strategy.run.preempt import grace_from
from resilient_strategy.testing import machine

ROOT = Path(__file__).parents[1]
BASE = json.loads((ROOT / "examples" / "machines" / "h200x2_nvlink.json").read_text())
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
#: Every variable of ours read while deciding or supervising.
VARS = ("RESILIENT_STRATEGY_CACHE", "RESILIENT_STRATEGY_CACHE_DIR", "RESILIENT_STRATEGY_PROBE",
        "RESILIENT_STRATEGY_QUIET", "RESILIENT_STRATEGY_TIMEOUT", "RESILIENT_STRATEGY_PG_TIMEOUT",
        "RESILIENT_STRATEGY_PREFER", "RESILIENT_STRATEGY_RULES",
        "RESILIENT_STRATEGY_DISABLE_RULES", "RESILIENT_STRATEGY_STALL_TIMEOUT",
        "RESILIENT_STRATEGY_MAX_RELAUNCHES", "RESILIENT_STRATEGY_FORKSERVER",
        "RESILIENT_STRATEGY_DECISION", "RESILIENT_STRATEGY_TRAIN_FAULT",
        "RESILIENT_STRATEGY_PROGRESS", "RESILIENT_STRATEGY_SIGNATURES",
        "RESILIENT_STRATEGY_REMEDIES", "RESILIENT_STRATEGY_PROBE_FAULT",
        "RESILIENT_STRATEGY_CHECKPOINT_ASYNC", "RESILIENT_STRATEGY_WARM_START",
        "RESILIENT_STRATEGY_MEASURED_SWITCH", "RESILIENT_STRATEGY_PREEMPT_GRACE_S")
#: One malformed value (or more) per variable (issue 32): each is refused where it is read,
#: with one line naming the variable; none turns a feature off silently.
MALFORMED = (
    ("RESILIENT_STRATEGY_CACHE", "maybe"),
    ("RESILIENT_STRATEGY_CACHE_DIR", "/tmp/a\0b"),
    ("RESILIENT_STRATEGY_CHECKPOINT_ASYNC", "later"),
    ("RESILIENT_STRATEGY_DECISION", "/dev/zero"),
    ("RESILIENT_STRATEGY_DISABLE_RULES", "no-such-rule"),
    ("RESILIENT_STRATEGY_FORKSERVER", "off please"),
    ("RESILIENT_STRATEGY_MAX_RELAUNCHES", "-1"),
    ("RESILIENT_STRATEGY_PG_TIMEOUT", "nan"),
    ("RESILIENT_STRATEGY_PREFER", "mpi"),
    ("RESILIENT_STRATEGY_PROBE", "sometimes"),
    ("RESILIENT_STRATEGY_PROBE_FAULT", "explode:1"),  # was: the cache off, nothing injected
    ("RESILIENT_STRATEGY_PROBE_FAULT", "exit:1:glooo"),  # and a passing "rehearsal"
    ("RESILIENT_STRATEGY_PROBE_FAULT", "hang:one"),
    ("RESILIENT_STRATEGY_PROBE_FAULT", "wrong:1:nccl:bigger"),
    ("RESILIENT_STRATEGY_PROGRESS", "/tmp/a\0b"),
    ("RESILIENT_STRATEGY_QUIET", "loud"),
    ("RESILIENT_STRATEGY_REMEDIES", "/nonexistent/remedies.toml"),
    ("RESILIENT_STRATEGY_RULES", "/nonexistent/rules.toml"),
    ("RESILIENT_STRATEGY_SIGNATURES", "/nonexistent/signatures.toml"),
    ("RESILIENT_STRATEGY_STALL_TIMEOUT", "soon"),
    ("RESILIENT_STRATEGY_TIMEOUT", "1e999"),
    ("RESILIENT_STRATEGY_TRAIN_FAULT", "hang:one:gloo:3"),
    ("RESILIENT_STRATEGY_TRAIN_FAULT", "explode:0:gloo:3"),
    ("RESILIENT_STRATEGY_WARM_START", "sometimes"),
    ("RESILIENT_STRATEGY_MEASURED_SWITCH", "faster"),
    ("RESILIENT_STRATEGY_PREEMPT_GRACE_S", "soon"),  # was the default in silence
    ("RESILIENT_STRATEGY_PREEMPT_GRACE_S", "-5"),
)


def _read_all(env: dict[str, str]) -> None:
    """Everything that reads our variables before a decision or a run."""
    options_from(machine(2), env, Arguments.from_kwargs(framework="torch", global_batch_size=64, devices=None,
                 probe=None, timeout=None, prefer=None, dry_run=False, model=None,
                 gradient_bytes=None, sample_seconds=None, max_per_replica_batch=None, rules=(),
                 disable_rules=(), cache=True, cache_dir=None, cache_ttl=None, precision="auto",
                 logical_cpus=0))
    run_options_from(env, script="train.py", script_args=(), framework=None, nproc="auto",
                     max_relaunches=None, stall_timeout=None, global_batch_size=None,
                     gradient_bytes=None, probe_timeout=None, logical_cpus=0)
    handoff.load_decision(env, handoff.WorkerState())
    parse_fault(env.get("RESILIENT_STRATEGY_TRAIN_FAULT", ""))
    grace_from(env)


def _one_line_naming(name: str, value: str) -> ResilientStrategyError:
    with pytest.raises(ResilientStrategyError) as exc:
        _read_all({name: value})
    assert name in str(exc.value)
    return exc.value


@pytest.mark.parametrize(("name", "value"), [
    ("RESILIENT_STRATEGY_DISABLE_RULES", "no-such-rule"),  # was silently ignored
    ("RESILIENT_STRATEGY_MAX_RELAUNCHES", "5000"),  # was named as --max-relaunches
    ("RESILIENT_STRATEGY_MAX_RELAUNCHES", "-1"),
    ("RESILIENT_STRATEGY_DECISION", "/dev/zero"),  # was a MemoryError
    ("RESILIENT_STRATEGY_CACHE", "maybe"),
    ("RESILIENT_STRATEGY_FORKSERVER", "off please"),
    ("RESILIENT_STRATEGY_CACHE_DIR", "/tmp/a\0b"),
    ("RESILIENT_STRATEGY_RULES", "/nonexistent/rules.toml"),
    ("RESILIENT_STRATEGY_TIMEOUT", "1e999"),
    ("RESILIENT_STRATEGY_SIGNATURES", "/nonexistent/signatures.toml"),
    ("RESILIENT_STRATEGY_REMEDIES", "/nonexistent/remedies.toml"),
])
def test_a_bad_variable_is_one_error_naming_it(name: str, value: str) -> None:
    err = _one_line_naming(name, value)
    assert option_of(err) in (name, None)


@pytest.mark.parametrize(("name", "value"), MALFORMED)
def test_every_variable_refuses_a_malformed_value_in_one_line(name: str, value: str) -> None:
    from resilient_strategy.errors import InvalidOptionError

    err = _one_line_naming(name, value)
    assert isinstance(err, InvalidOptionError) and option_of(err) == name
    assert "\n" not in str(err)


def test_the_malformed_table_covers_every_variable_the_package_reads() -> None:
    import re

    src = ROOT / "src" / "resilient_strategy"
    named = {m for p in src.rglob("*.py")
             for m in re.findall(r"RESILIENT_STRATEGY_[A-Z_]+[A-Z]", p.read_text(encoding="utf-8"))}
    assert named == {n for n, _ in MALFORMED} == set(VARS)


def test_a_train_fault_on_a_rank_the_job_lacks_is_refused() -> None:
    from resilient_strategy.errors import InvalidOptionError
    from resilient_strategy.records.trainfault import FAULT_VAR, check_rank

    fault = parse_fault("exit:2:gloo:3")
    check_rank(fault, 3)  # ranks 0-2: rank 2 is one
    check_rank(None, 1)
    with pytest.raises(InvalidOptionError) as exc:
        check_rank(fault, 2)
    assert exc.value.option == FAULT_VAR and "\n" not in str(exc.value)


def option_of(err: ResilientStrategyError) -> str | None:
    return getattr(err, "option", None)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_decision_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "decision.json"
    os.mkfifo(fifo)
    errors: list[BaseException] = []

    def load() -> None:
        try:
            handoff.load_decision({"RESILIENT_STRATEGY_DECISION": str(fifo)},
                                  handoff.WorkerState())
        except BaseException as exc:  # collected for the assertion below
            errors.append(exc)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(5.0)
    assert not t.is_alive() and len(errors) == 1
    assert isinstance(errors[0], ResilientStrategyError)


def _simulate(data: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "machine.json"
        path.write_text(json.dumps(data))
        return simulate_file(path)


@pytest.mark.parametrize(("where", "value"), [
    (("machine", "gpus"), 5000),  # was 159 s and 8 GB
    (("machine", "gpus"), 10**9),  # was a MemoryError
    (("machine", "memory_gb"), 1e300),  # was an OverflowError
    (("machine", "nvlink"), -(2**60)),
    (("probes",), {"nccl": "ok:nan"}),  # were accepted
    (("probes",), {"nccl": "ok:-1"}),
    (("probes",), {"nccl": "ok:fast"}),
])
def test_a_bad_simulate_field_is_one_clean_error(where: tuple[str, ...], value: Any) -> None:
    data = copy.deepcopy(BASE)
    target = data
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    with pytest.raises(ResilientStrategyError):
        _simulate(data)


def test_the_cli_answers_a_huge_machine_with_exit_2(tmp_path: Path) -> None:
    data = copy.deepcopy(BASE)
    data["machine"]["gpus"] = 5000
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    assert main(["plan", "--simulate", str(path)]) == 2


# ----- fuzzers (fixed budget, derandomized: the same examples every run) ----------------------
_TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "0", "1", "-1", "nan", "inf", "1e999", "9" * 5000, "/dev/zero", ".",
                     "a\0b", "auto", "never", "nccl", "true", "error:0:gloo:1", "hang:x:y:z"]),
)


@FUZZ
@given(name=st.sampled_from(VARS), value=_TEXT)
def test_fuzz_environment_variables(name: str, value: str) -> None:
    try:
        _read_all({name: value})
    except ResilientStrategyError as exc:
        assert name in str(exc) or name.endswith("_FAULT")  # the fault's own words name it
    # anything else (a raw traceback) fails the test


_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=6)
_FIELDS = [("machine", k) for k in BASE["machine"]] + [
    ("global_batch_size",), ("gradient_bytes",), ("probes",), ("framework",), ("machine",)]


@FUZZ
@given(where=st.sampled_from(_FIELDS), value=_JSON)
def test_fuzz_simulate_files(where: tuple[str, ...], value: Any) -> None:
    data = copy.deepcopy(BASE)
    target = data
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    try:
        decided = _simulate(data)
    except ResilientStrategyError as exc:  # one clean error; anything else fails the test
        assert "\n" not in str(exc).strip() or "machine.json" in str(exc)
    else:
        assert all(sel.backend for sel in decided.values())


def test_plan_simulate_writes_no_agreement_file(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A simulated torchrun rank 0 with probes decides alone: nothing is written to the shared
    temporary directory (where a squatter could make it fail)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    data = copy.deepcopy(BASE)
    data["probes"] = {"nccl": "timeout"}
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(data))
    before = sorted(p.name for p in tmp_path.iterdir())
    decided = simulate_file(path)
    # the probed plain NCCL timed out: something else was chosen (NCCL with a remedy, on every
    # GPU, since issue 41 keeps proven GPUs), after probing
    assert (decided["torch"].backend, decided["torch"].candidate.env) != ("nccl", ())
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize(("argv", "option"), [
    (["--nnodes", "abc"], "--nnodes"),
    (["--nnodes", "2:1"], "--nnodes"),
    (["--master-port", "70000"], "--master-port"),
    (["--rdzv-endpoint", "::::"], "--rdzv-endpoint"),
    (["--rdzv-endpoint", "[::1"], "--rdzv-endpoint"),
    (["--node-rank", "-1"], "--node-rank"),
])
def test_bad_node_options_of_run_name_their_flag(argv: list[str], option: str) -> None:
    """torchrun's node options are checked before torch reads them (it raised a ValueError
    traceback from deep inside for each of these)."""
    pytest.importorskip("torch")
    from resilient_strategy.errors import InvalidOptionError
    from resilient_strategy.run.cmdline import options_from_args

    with pytest.raises(InvalidOptionError) as err:
        options_from_args([*argv, "train.py"])
    assert err.value.option == option


def test_good_node_options_of_run_pass() -> None:
    pytest.importorskip("torch")
    from resilient_strategy.run.cmdline import options_from_args

    for argv in (["--nnodes", "1:2"], ["--rdzv-endpoint", "[::1]:29500"],
                 ["--rdzv-endpoint", "node0"], ["--master-port", "0"]):
        assert options_from_args([*argv, "train.py"]).script == "train.py"


# ----- resilient_strategy()'s arguments and the command line: one line each (issue 32) -------
def test_an_argument_error_is_typed_and_raised_one_frame_below_the_caller() -> None:
    import traceback

    from resilient_strategy import resilient_strategy
    from resilient_strategy.errors import InvalidOptionError

    with pytest.raises(InvalidOptionError) as exc:
        resilient_strategy(framework="torch", global_batch_size=-3, facts=machine(2), env={},
                           cache=False, dry_run=True)
    frames = traceback.extract_tb(exc.value.__traceback__)
    # the caller (this test), then resilient_strategy() itself: not the library's internals
    assert [f.name for f in frames][1:] == ["resilient_strategy"]
    assert exc.value.option == "global_batch_size" and "\n" not in str(exc.value)
    assert exc.value.__cause__ is None and exc.value.__suppress_context__


def test_an_unknown_keyword_is_a_type_error_naming_the_closest_one() -> None:
    from resilient_strategy import resilient_strategy

    with pytest.raises(TypeError) as exc:
        resilient_strategy(framework="torch", global_batchsize=256)  # type: ignore[call-arg]
    assert "'global_batch_size'" in str(exc.value) and "'global_batchsize'" in str(exc.value)
    with pytest.raises(TypeError) as far:
        resilient_strategy(zzzz=1)  # type: ignore[call-arg]
    assert "'zzzz'" in str(far.value) and "did you mean" not in str(far.value)


@pytest.mark.parametrize("argv", [
    ["run"], ["run", "DIR"], ["run", "--nproc-per-node", "x", "train.py"],
    ["run", "--bogus", "1", "train.py"], [], ["plan", "--bogus"],
])
def test_each_command_line_error_is_one_line(argv: list[str], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(tmp_path) if a == "DIR" else a for a in argv]
    try:
        code = main(argv)
    except SystemExit as done:
        code = int(done.code or 0)
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert len(out.err.strip().splitlines()) == 1, out.err
    if argv[1:] == [str(tmp_path)]:  # a directory is said to be one, not "no such script"
        assert str(tmp_path) in out.err and "no such script" not in out.err
