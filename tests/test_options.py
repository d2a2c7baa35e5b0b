"""Options: every option has a validated range, checked once where it is read, and the error
names the argument or environment variable the value came from."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient_strategy.core.call.arguments import Arguments, options_from
from resilient_strategy.core.call.options import Launch, Options
from resilient_strategy.errors import InvalidOptionError
from resilient_strategy.testing import machine, simulate
from resilient_strategy.vocab import BACKENDS, FRAMEWORKS, PRECISIONS, PROBE_MODES

H200X2 = machine(2, nvlink=18)


def _options(env: dict[str, str] | None = None, **kw: Any) -> Options:
    base: dict[str, Any] = dict(
        framework="torch", global_batch_size=64, devices=None, probe=None, timeout=None,
        prefer=None, dry_run=False, model=None, gradient_bytes=None, sample_seconds=None,
        max_per_replica_batch=None, rules=(), disable_rules=(), cache=False, cache_dir=None,
        cache_ttl=None, precision="auto", logical_cpus=0)
    base.update(kw)
    return options_from(H200X2, env or {}, Arguments.from_kwargs(**base))


@pytest.mark.parametrize(
    ("env", "option"),
    [
        ({"RESILIENT_STRATEGY_PG_TIMEOUT": "inf"}, "RESILIENT_STRATEGY_PG_TIMEOUT"),
        ({"RESILIENT_STRATEGY_PG_TIMEOUT": "1e15"}, "RESILIENT_STRATEGY_PG_TIMEOUT"),
        ({"RESILIENT_STRATEGY_PG_TIMEOUT": "nan"}, "RESILIENT_STRATEGY_PG_TIMEOUT"),
        ({"RESILIENT_STRATEGY_PG_TIMEOUT": "0"}, "RESILIENT_STRATEGY_PG_TIMEOUT"),
        ({"RESILIENT_STRATEGY_TIMEOUT": "soon"}, "RESILIENT_STRATEGY_TIMEOUT"),
        ({"RESILIENT_STRATEGY_TIMEOUT": "inf"}, "RESILIENT_STRATEGY_TIMEOUT"),
        ({"RESILIENT_STRATEGY_PROBE": "sometimes"}, "RESILIENT_STRATEGY_PROBE"),
        ({"RESILIENT_STRATEGY_PREFER": "mpi"}, "RESILIENT_STRATEGY_PREFER"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK"),
        ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "2"}, "LOCAL_RANK"),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE"),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE"),
    ],
)
def test_a_bad_environment_value_names_its_variable(env: dict[str, str], option: str) -> None:
    with pytest.raises(InvalidOptionError) as err:
        _options(env)
    assert err.value.option == option


@pytest.mark.parametrize(
    ("kw", "option"),
    [
        ({"process_group_timeout": math.inf}, "process_group_timeout"),
        ({"process_group_timeout": 1e15}, "process_group_timeout"),
        ({"cache_ttl": math.nan}, "cache_ttl"),
        ({"cache_ttl": math.inf}, "cache_ttl"),
        ({"cache_ttl": 0}, "cache_ttl"),
        ({"cache_dir": 5}, "cache_dir"),
        ({"timeout": math.nan}, "timeout"),
        ({"timeout": 3601}, "timeout"),
        ({"sample_seconds": math.inf}, "sample_seconds"),
        ({"global_batch_size": 2**61 - 1}, "global_batch_size"),
        ({"global_batch_size": 0}, "global_batch_size"),
        ({"max_per_replica_batch": 2**40}, "max_per_replica_batch"),
        ({"gradient_bytes": 2**60}, "gradient_bytes"),
        ({"devices": [0, 0]}, "devices"),
        ({"devices": [-1]}, "devices"),
        ({"precision": "fp8"}, "precision"),
        ({"probe": "sometimes"}, "probe"),
        ({"prefer": "mpi"}, "prefer"),
        ({"framework": "jax"}, "framework"),
        ({"logical_cpus": 2}, "logical_cpus"),  # torch has no logical-CPU test mode
        ({"model": object()}, "model"),
    ],
)
def test_a_bad_argument_names_itself(kw: dict[str, Any], option: str) -> None:
    with pytest.raises(InvalidOptionError) as err:
        _options(**kw)
    assert err.value.option == option


def test_the_edges_of_the_ranges_are_accepted() -> None:
    o = _options({"RESILIENT_STRATEGY_PG_TIMEOUT": str(7 * 86400), "WORLD_SIZE": "2", "RANK": "1",
                  "LOCAL_RANK": "1"}, global_batch_size=2**31 - 2, cache_ttl=366 * 86400.0,
                 timeout=3600, cache_dir=Path("x"))
    assert (o.process_group_timeout, o.timeout_s, o.global_batch_size) == (7 * 86400.0, 3600.0, 2**31 - 2)
    assert o.launch == Launch(rank=1, local_rank=1, world_size=2)


def test_the_largest_global_batch_plans_at_once() -> None:
    """The batch split's divisor search is bounded by the range (2**31 - 1 is prime)."""
    sel = simulate(H200X2, framework="torch", global_batch_size=2**31 - 1)
    assert sel.global_batch_size == 2**31 - 1
    assert sel.num_replicas * sel.per_replica_batch_size * sel.accumulation_steps == 2**31 - 1


def test_the_vocabularies_are_one_set_of_words() -> None:
    assert FRAMEWORKS == ("torch", "tensorflow")
    assert set(PROBE_MODES) == {"auto", "force", "never"}
    assert "auto" in PRECISIONS and "cpu" in BACKENDS
    for fw in FRAMEWORKS:
        assert Options(fw).framework == fw


def test_launch_is_the_launchers_view_and_the_planner_splits_over_torch_processes() -> None:
    tf = machine(2, tensorflow="2.21.0", tf_cuda="12.5", torch=None)
    o = options_from(tf, {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"},
                     Arguments.from_kwargs(framework="tensorflow", global_batch_size=None, devices=None, probe=None,
                     timeout=None, prefer=None, dry_run=False, model=None, gradient_bytes=None,
                     sample_seconds=None, max_per_replica_batch=None, rules=(), disable_rules=(),
                     cache=False, cache_dir=None, cache_ttl=None, precision="auto",
                     logical_cpus=0))
    assert (o.processes, o.world_size, o.launch.world_size, o.launch.rank) == (1, 2, 2, 1)


def test_the_torch_runtime_names_the_bad_value() -> None:
    from resilient_strategy.frameworks.torch import TorchRuntime

    base: dict[str, Any] = dict(rank=0, local_rank=0, world_size=1)
    with pytest.raises(InvalidOptionError) as timeout:
        TorchRuntime("cpu", (), 1, 8, 8, timeout_s=math.inf, **base)
    with pytest.raises(InvalidOptionError) as precision:
        TorchRuntime("cpu", (), 1, 8, 8, timeout_s=60, precision="fp8", **base)
    assert (timeout.value.option, precision.value.option) == ("process_group_timeout", "precision")


def test_every_option_of_resilient_strategy_is_a_field_of_arguments_with_its_default() -> None:
    import inspect

    from resilient_strategy.deciding.executor import resilient_strategy

    params = inspect.signature(resilient_strategy).parameters
    public = {p: v.default for p, v in params.items()  # **unknown: only to name the closest
              if v.kind is not v.VAR_KEYWORD and p not in ("env", "facts")}
    # one value, one default per option: the signature's defaults are the value's
    assert public == Arguments().flat()
    assert set(Arguments.names()) == set(public)
    assert Arguments.from_kwargs(framework="torch", cache=False).training.framework == "torch"
    with pytest.raises(TypeError):
        Arguments.from_kwargs(no_such_option=1)
    with pytest.raises(TypeError):  # the private injection is gone: the testing kit's Engine
        resilient_strategy(_prober=lambda spec, env: None)  # type: ignore[call-arg]


def test_an_option_flows_from_resilient_strategy_to_the_probe_spec() -> None:
    from resilient_strategy.deciding.executor import resilient_strategy
    from resilient_strategy.testing import SimulatedProber

    torchrun = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    facts = machine(2, nvlink=18, env=torchrun)
    prober = SimulatedProber()
    simulate(facts, prober, framework="torch", timeout=7.0, gradient_bytes=4 << 20,
             sample_seconds=1e-3, global_batch_size=64, alone=True)
    spec = prober.calls[0]
    assert (spec.timeout_s, spec.check_bytes, spec.world_size) == (7.0, (4 << 20,), 2)
    # the public function takes the same road: its arguments, as one value, to the engine
    assert resilient_strategy(framework="torch", facts=facts, env={}, timeout=7.0,
                              dry_run=True, cache=False).dry_run


def test_run_argv_flows_to_a_relaunchs_options(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient_strategy.core.measures.probe import TIMEOUT, ProbeResult
    from resilient_strategy.run import supervisor
    from resilient_strategy.run.cmdline import options_from_args
    from resilient_strategy.testing import SimulatedProber

    script = tmp_path / "train.py"
    script.write_text("import torch\n")
    run = options_from_args(["--framework", "torch", "--probe-timeout", "7",
                             "--global-batch-size", "64", "--gradient-bytes", str(4 << 20),
                             "--nproc-per-node", "2", str(script)])
    assert Arguments.from_run(run).probing.timeout == 7.0
    facts = machine(2, nvlink=18, torch="2.13.0")
    prober = SimulatedProber()
    monkeypatch.setattr(supervisor, "_prober", prober)
    env = {"RESILIENT_STRATEGY_CACHE_DIR": str(tmp_path / "cache")}  # never the user's cache
    first = supervisor._decide(run, facts, env, {}, tmp_path, 0, ())
    failed = ProbeResult(first.decision.chosen, TIMEOUT, 7.0, "timeout", "mid-run")
    prober.calls.clear()
    relaunch = supervisor._decide(run, facts, env, {first.decision.chosen: failed}, tmp_path, 1,
                                  ())
    assert relaunch.decision.chosen != first.decision.chosen
    assert relaunch.decision.global_batch_size == 64
    assert prober.calls and {(c.timeout_s, c.check_bytes) for c in prober.calls} == {
        (7.0, (4 << 20,))}


_VARIABLES = ["RESILIENT_STRATEGY_PROBE", "RESILIENT_STRATEGY_TIMEOUT",
              "RESILIENT_STRATEGY_PG_TIMEOUT", "RESILIENT_STRATEGY_PREFER", "RESILIENT_STRATEGY_CACHE",
              "RESILIENT_STRATEGY_DISABLE_RULES", "RANK", "LOCAL_RANK", "WORLD_SIZE",
              "LOCAL_WORLD_SIZE"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(_VARIABLES),
                       st.one_of(st.text(max_size=12), st.integers(-3, 10**20).map(str),
                                 st.floats(allow_nan=True, allow_infinity=True).map(str)),
                       max_size=6))
def test_any_environment_gives_options_or_a_typed_error(env: dict[str, str]) -> None:
    try:
        o = _options(env, global_batch_size=None)
    except InvalidOptionError as exc:
        assert exc.option in (*_VARIABLES, "global_batch_size", None)
        return
    assert 0 <= o.rank < o.world_size and 0 < o.timeout_s <= 3600
    assert math.isfinite(o.process_group_timeout)
