"""Reading the arguments of ``resilient_strategy()`` and the environment into `Options`
(explicit argument > the user's environment > our default), and ``resilient-strategy run``'s
command line into `RunOptions`.

Slightly over ~450 lines: every argument and every ``RESILIENT_STRATEGY_*`` variable is read
and checked here, once, so that each error names what the user typed.

The arguments travel as one value, `Arguments`, in small groups (training, model, probing,
cache, rules), with one constructor per source (the call, keywords, ``run``'s options, the
command line); `options_from` reads it, and the environment, into `Options`.
Every ``RESILIENT_STRATEGY_*`` variable is checked once (`check_environment`), its error
naming the variable and what it holds.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from ...errors import FrameworkNotInstalledError, InvalidOptionError, InvalidRuleError
from ...vocab import (
    BACKENDS,
    FRAMEWORK_ALIASES,
    FRAMEWORKS,
    PROBE_MODES,
)
from ..knowledge.remedies import ENV_VAR as REMEDIES_VAR
from ..knowledge.remedies import load_remedies
from ..knowledge.rules import Rule, load_rules
from ..knowledge.signatures import signatures_from_env
from ..values.facts import Facts
from ..values.tfcluster import VAR as TF_CONFIG_VAR
from ..values.tfcluster import parse_tf_config
from .model import gradient_bytes_of, unit_bytes_of
from .options import (
    CHECKPOINT_ASYNC_VAR,
    DEFAULT_MEASURED_SWITCH,
    DEFAULT_OPTIMIZER_STATE_FACTOR,
    DEFAULT_PROCESS_GROUP_TIMEOUT,
    DEFAULT_TIMEOUT_S,
    DEFAULT_TTL_S,
    DEFAULT_WARM_START,
    MAX_PROCESS_GROUP_TIMEOUT,
    MAX_RELAUNCHES,
    MAX_STALL_TIMEOUT_S,
    MAX_TIMEOUT_S,
    MAX_WORLD_SIZE,
    MIN_STALL_S,
    Launch,
    Options,
    RunOptions,
    default_dir,
)
from .probe_fault import PROBE_FAULT_VAR, parse_probe_fault


def _env_list(env: Mapping[str, str], name: str, sep: str = ",") -> list[str]:
    return [x.strip() for x in env.get(name, "").split(sep) if x.strip()]


#: The library's on/off variables: 1 or 0 (true / false too); empty is unset.
FLAG_VARS = ("RESILIENT_STRATEGY_CACHE", "RESILIENT_STRATEGY_FORKSERVER", CHECKPOINT_ASYNC_VAR,
             "RESILIENT_STRATEGY_WARM_START", "RESILIENT_STRATEGY_MEASURED_SWITCH")
#: ``resilient-strategy run``'s warm start of its workers (``--warm-start``), on or off.
WARM_START_VAR = "RESILIENT_STRATEGY_WARM_START"
#: ``resilient-strategy run``'s measured switch (``--measured-switch``), on or off.
MEASURED_SWITCH_VAR = "RESILIENT_STRATEGY_MEASURED_SWITCH"
#: The library's variables that name files or directories (several, for RULES).
PATH_VARS = ("RESILIENT_STRATEGY_CACHE_DIR", "RESILIENT_STRATEGY_RULES",
             "RESILIENT_STRATEGY_DECISION", "RESILIENT_STRATEGY_PROGRESS",
             "RESILIENT_STRATEGY_SIGNATURES", "RESILIENT_STRATEGY_REMEDIES")
MAX_PATH_CHARS = 4096
_TRUE, _FALSE = ("1", "true"), ("0", "false")


def shown(text: str, limit: int = 120) -> str:
    """What the user typed, quoted and cut to ``limit`` characters, for an error line."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} chars)"


def env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """An on/off variable (`FLAG_VARS`): 1/true, 0/false, unset or empty: ``default``."""
    text = env.get(name, "").strip().lower()
    if not text:
        return default
    if text not in (*_TRUE, *_FALSE):
        raise InvalidOptionError(f"{name}={shown(env[name])}: expected 1 or 0", name)
    return text in _TRUE


def check_environment(env: Mapping[str, str]) -> None:
    """The checks of this library's variables that no one reader owns: on/off values and paths
    (no NUL byte, at most `MAX_PATH_CHARS`). Each error names the variable and what it
    holds. The others are checked where they are read, with the same kind of error."""
    for name in FLAG_VARS:
        env_flag(env, name, True)
    for name in PATH_VARS:
        text = env.get(name, "")
        if "\0" in text or len(text) > MAX_PATH_CHARS:
            raise InvalidOptionError(
                f"{name}={shown(text)}: not a path (a NUL character, or more than "
                f"{MAX_PATH_CHARS} characters)", name)


_T = TypeVar("_T")


def _named(env: Mapping[str, str], name: str, read: Callable[[], _T]) -> _T:
    """``read()`` of what variable ``name`` names; its error says the variable and its value."""
    try:
        return read()
    except (InvalidRuleError, InvalidOptionError) as exc:
        if name not in env:
            raise
        raise InvalidOptionError(f"{name}={shown(env[name])}: {exc}", name) from None


def _env_rules(env: Mapping[str, str]) -> list[str]:
    """RESILIENT_STRATEGY_RULES: rule files (os.pathsep between), each readable and valid."""
    name = "RESILIENT_STRATEGY_RULES"
    files = _env_list(env, name, os.pathsep)
    if files:
        try:
            load_rules(files)
        except (InvalidRuleError, InvalidOptionError) as exc:
            raise InvalidOptionError(f"{name}={shown(env[name])}: {exc}", name) from None
    return files


def _env_disabled_rules(env: Mapping[str, str], extra: Sequence[str | Path | Rule]) -> list[str]:
    """RESILIENT_STRATEGY_DISABLE_RULES: rule ids (commas between), each one a rule has (as
    ``--disable-rule`` demands: a typo would leave the rule on without a word)."""
    name = "RESILIENT_STRATEGY_DISABLE_RULES"
    ids = _env_list(env, name)
    if ids:
        known = {r.id for r in load_rules(extra)}
        unknown = sorted(set(ids) - known)
        if unknown:
            raise InvalidOptionError(
                f"{name}={shown(env[name])}: no rule has the id {', '.join(unknown)}. Known rule "
                f"ids: {', '.join(sorted(known))}", name)
    return ids


def _env_int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    text = env.get(name)
    if text is None or (text == "" and name == "LOCAL_WORLD_SIZE"):
        return default
    try:
        return int(text)
    except ValueError:
        raise InvalidOptionError(f"{name}={shown(text)}: expected an integer", name) from None


def _env_seconds(env: Mapping[str, str], name: str, default: float, top: float) -> float:
    text = env.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= top):
        raise InvalidOptionError(
            f"{name}={shown(text)}: expected a number of seconds in (0, {top:g}]", name)
    return value


def _launch(env: Mapping[str, str]) -> Launch:
    """The launcher's variables, as integers (their ranges are checked by Options)."""
    world = _env_int(env, "WORLD_SIZE", 1)
    if world is None or not 1 <= world <= MAX_WORLD_SIZE:
        raise InvalidOptionError(
            f"WORLD_SIZE={world}: expected 1 to {MAX_WORLD_SIZE} processes", "WORLD_SIZE")
    local_world = _env_int(env, "LOCAL_WORLD_SIZE", None)
    if local_world is not None and not 1 <= local_world <= world:
        raise InvalidOptionError(
            f"LOCAL_WORLD_SIZE={local_world}: expected 1 to WORLD_SIZE ({world})",
            "LOCAL_WORLD_SIZE")
    return Launch(rank=_env_int(env, "RANK", 0) or 0, local_rank=_env_int(env, "LOCAL_RANK", 0) or 0,
                  world_size=world, local_world_size=local_world)


def _pick_framework(framework: str | None, facts: Facts) -> tuple[str, str]:
    if framework is not None:
        name = FRAMEWORK_ALIASES.get(framework, framework)
        if name not in FRAMEWORKS:
            near = _closest(framework, (*FRAMEWORKS, *FRAMEWORK_ALIASES))
            raise InvalidOptionError(
                f"framework must be 'torch' or 'tensorflow', not {framework!r}"
                + (f" (did you mean {near!r}?)" if near else ""), "framework", suggestion=near)
        if not facts.framework(name).installed:
            raise FrameworkNotInstalledError(name)
        return name, f"framework={framework!r} as asked"
    imported = [f for f in FRAMEWORKS if facts.framework(f).imported]
    installed = [f for f in FRAMEWORKS if facts.framework(f).installed]
    if len(imported) == 1:
        return imported[0], f"framework=None: {imported[0]} is the one already imported"
    if len(installed) == 1:
        return installed[0], f"framework=None: {installed[0]} is the one installed"
    if not installed:
        raise FrameworkNotInstalledError(None)
    raise InvalidOptionError(
        "framework=None but both torch and tensorflow are installed"
        + (" and imported" if imported else "")
        + "; pass framework='torch' or framework='tensorflow'",
        "framework",
    )


def _number(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidOptionError(f"{name} must be a number of seconds, not {value!r}", name)
    return float(value)


def _iterable(name: str, value: Any) -> list[Any]:
    try:
        return list(value)
    except TypeError:
        raise InvalidOptionError(f"{name} must be a sequence, not {value!r}", name) from None


@dataclass(frozen=True)
class TrainingArgs:
    """What trains: the framework, the global batch, the devices, precision, the training
    collectives' timeout and sharding."""

    framework: str | None = None
    global_batch_size: int | None = None
    devices: Sequence[int] | None = None
    precision: str = "auto"
    logical_cpus: int = 0
    process_group_timeout: float | None = None
    sharding: str = "auto"
    offload: str = "none"


@dataclass(frozen=True)
class ModelArgs:
    """How big the model is: for the cost model and memory planning."""

    model: Any = field(default=None, compare=False)
    gradient_bytes: int | None = None
    param_bytes: int | None = None
    optimizer_state_factor: float | None = None
    sample_seconds: float | None = None
    max_per_replica_batch: int | None = None


@dataclass(frozen=True)
class ProbingArgs:
    """How to prove: probe mode, the probe timeout, a preferred backend, dry run, quiet."""

    probe: str | bool | None = None
    timeout: float | None = None
    prefer: str | None = None
    dry_run: bool = False
    quiet: bool | None = None


@dataclass(frozen=True)
class CacheArgs:
    """Where proofs are kept."""

    cache: bool = True
    cache_dir: str | Path | None = None
    cache_ttl: float | None = None


@dataclass(frozen=True)
class RuleArgs:
    """The user's known-issue rules, and the built-in ones they turn off."""

    rules: Sequence[str | Path | Rule] = ()
    disable_rules: Sequence[str] = ()


@dataclass(frozen=True)
class Arguments:
    """The one options value: what was asked of a decision, as passed, in groups; every
    default is defined here, once, and validated once (by `options_from`, into `Options`).

    One constructor per source: ``resilient_strategy()`` builds it field by field from its
    parameters; `from_kwargs` from keywords (the testing kit's entries); `from_run` from
    ``resilient-strategy run``'s `RunOptions` (the supervisor's and each relaunch's
    decision); `from_cli` from the ``doctor`` / ``plan`` / ``probe`` command line.
    """

    training: TrainingArgs = field(default_factory=TrainingArgs)
    model: ModelArgs = field(default_factory=ModelArgs)
    probing: ProbingArgs = field(default_factory=ProbingArgs)
    cache: CacheArgs = field(default_factory=CacheArgs)
    rules: RuleArgs = field(default_factory=RuleArgs)

    #: The groups, by the name of their field here.
    GROUPS: ClassVar[tuple[tuple[str, type], ...]] = (
        ("training", TrainingArgs), ("model", ModelArgs), ("probing", ProbingArgs),
        ("cache", CacheArgs), ("rules", RuleArgs))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every argument's name (``resilient_strategy()``'s keyword for it)."""
        return tuple(f.name for _, group in cls.GROUPS for f in fields(group))

    def flat(self) -> dict[str, object]:
        """Every argument by its name, as `names` lists them."""
        return {f.name: getattr(getattr(self, g), f.name)
                for g, group in self.GROUPS for f in fields(group)}

    @classmethod
    def from_kwargs(cls, **keywords: Any) -> Arguments:
        """The value from ``resilient_strategy()``'s keywords (``env`` and ``facts`` are not
        options: not here); an unknown one is a TypeError naming the closest known one, as
        ``resilient_strategy()`` says it."""
        unknown = sorted(set(keywords) - set(cls.names()))
        if unknown:
            raise TypeError(unexpected_keywords("Arguments.from_kwargs()", unknown, cls.names()))
        groups: dict[str, Any] = {}
        for name, group in cls.GROUPS:
            mine = {f.name for f in fields(group)}
            groups[name] = group(**{k: v for k, v in keywords.items() if k in mine})
        return cls(**groups)

    @classmethod
    def from_run(cls, run: RunOptions) -> Arguments:
        """What ``resilient-strategy run`` asks of each decision it makes (the first and every
        relaunch's): its ``--framework``, ``--global-batch-size``, ``--gradient-bytes``,
        ``--param-bytes``, ``--optimizer-state-factor``, ``--probe-timeout``,
        ``--logical-cpus``, ``--sharding`` and ``--offload``; the rest at their defaults."""
        return cls(
            training=TrainingArgs(framework=run.framework,
                                  global_batch_size=run.global_batch_size,
                                  logical_cpus=run.logical_cpus, sharding=run.planned_sharding,
                                  offload=run.planned_offload),
            model=ModelArgs(gradient_bytes=run.gradient_bytes, param_bytes=run.param_bytes,
                            optimizer_state_factor=run.optimizer_state_factor),
            probing=ProbingArgs(timeout=run.probe_timeout_s))

    @classmethod
    def from_cli(cls, ns: argparse.Namespace, framework: str,
                 described: Mapping[str, Any] | None = None) -> Arguments:
        """What ``doctor`` / ``plan`` / ``probe`` ask for ``framework``: the command line's
        flags, then the ``--simulate`` file's (``described``: its JSON) for what the flags do
        not give."""
        d: Mapping[str, Any] = described or {}

        def given(flag: Any, key: str) -> Any:
            return flag if flag is not None else d.get(key)

        torch = framework == "torch"
        return cls(
            training=TrainingArgs(
                framework=framework,
                global_batch_size=given(ns.global_batch_size, "global_batch_size"),
                # a TensorFlow test mode: planning torch alongside it is unaffected
                logical_cpus=ns.logical_cpus if framework == "tensorflow" else 0,
                sharding=d.get("sharding", TrainingArgs.sharding),
                offload=d.get("offload", TrainingArgs.offload) if torch else TrainingArgs.offload),
            model=ModelArgs(gradient_bytes=given(ns.gradient_bytes, "gradient_bytes"),
                            sample_seconds=d.get("sample_seconds"),
                            param_bytes=d.get("param_bytes"),
                            optimizer_state_factor=d.get("optimizer_state_factor")),
            probing=ProbingArgs(timeout=ns.timeout),
            rules=RuleArgs(rules=tuple(ns.rules), disable_rules=tuple(ns.disable_rule)))


def _closest(typed: str, known: Sequence[str]) -> str | None:
    """The framework closest to a misspelt name (difflib, case ignored; an alias as the
    framework it stands for); None where none is close."""
    import difflib

    near = difflib.get_close_matches(typed.lower(), list(known), n=1)
    return FRAMEWORK_ALIASES.get(near[0], near[0]) if near else None


def unexpected_keywords(who: str, unknown: Sequence[str], known: Sequence[str]) -> str:
    """``who got an unexpected keyword argument 'x'``, with the closest known keyword where one
    is close (difflib)."""
    import difflib

    parts = []
    for name in sorted(unknown):
        near = difflib.get_close_matches(name, list(known), n=1)
        parts.append(f"{name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    s = "s" if len(parts) > 1 else ""
    return f"{who} got an unexpected keyword argument{s} {', '.join(parts)}"


def options_from(facts: Facts, env: Mapping[str, str], arguments: Arguments, /) -> Options:
    """Validate every argument once; environment variables fill what was not passed."""
    a = arguments
    t, m, pr, c = a.training, a.model, a.probing, a.cache
    framework, global_batch_size, devices = t.framework, t.global_batch_size, t.devices
    precision, logical_cpus, sharding = t.precision, t.logical_cpus, t.sharding
    offload = t.offload
    process_group_timeout = t.process_group_timeout
    model, gradient_bytes, param_bytes = m.model, m.gradient_bytes, m.param_bytes
    optimizer_state_factor, sample_seconds = m.optimizer_state_factor, m.sample_seconds
    max_per_replica_batch = m.max_per_replica_batch
    probe, timeout, prefer, dry_run, quiet = pr.probe, pr.timeout, pr.prefer, pr.dry_run, pr.quiet
    cache, cache_dir, cache_ttl = c.cache, c.cache_dir, c.cache_ttl
    rules, disable_rules = a.rules.rules, a.rules.disable_rules
    check_environment(env)
    if framework is not None and not isinstance(framework, str):
        raise InvalidOptionError(
            f"framework must be 'torch' or 'tensorflow', not {framework!r}", "framework")
    timeout = _number("timeout", timeout)
    cache_ttl = _number("cache_ttl", cache_ttl)
    sample_seconds = _number("sample_seconds", sample_seconds)
    group_timeout = _number("process_group_timeout", process_group_timeout)
    if devices is not None and (isinstance(devices, (str, bytes)) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in _iterable("devices", devices)
    )):
        raise InvalidOptionError(
            f"devices must be a sequence of GPU indices (ints), not {devices!r}", "devices")
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise InvalidOptionError(
            f"cache_dir must be a path (str or os.PathLike), not {cache_dir!r}", "cache_dir")
    if isinstance(rules, (str, Path)):  # one file, not a sequence of characters
        rules = (rules,)
    if isinstance(disable_rules, str):
        disable_rules = (disable_rules,)
    fw, why = _pick_framework(framework, facts)
    if probe is None:
        probe = env.get("RESILIENT_STRATEGY_PROBE", "auto")
        if probe not in PROBE_MODES:
            raise InvalidOptionError(
                f"RESILIENT_STRATEGY_PROBE={shown(probe)}: expected one of {PROBE_MODES}",
                "RESILIENT_STRATEGY_PROBE")
    if quiet is None and env.get("RESILIENT_STRATEGY_QUIET", "") != "":
        flag = env["RESILIENT_STRATEGY_QUIET"].strip().lower()
        if flag not in ("1", "0", "true", "false"):
            raise InvalidOptionError(
                f"RESILIENT_STRATEGY_QUIET={shown(flag)}: expected 1 (no progress line per probe) or "
                "0 (one even when stderr is not a terminal)", "RESILIENT_STRATEGY_QUIET")
        quiet = flag in ("1", "true")
    if probe is True:
        probe = "auto"
    if probe is False:
        probe = "never"
    if timeout is None:
        timeout = _env_seconds(env, "RESILIENT_STRATEGY_TIMEOUT", DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S)
    if group_timeout is None:
        group_timeout = _env_seconds(env, "RESILIENT_STRATEGY_PG_TIMEOUT", DEFAULT_PROCESS_GROUP_TIMEOUT,
                                  MAX_PROCESS_GROUP_TIMEOUT)
    if model is not None and gradient_bytes is None:
        gradient_bytes = gradient_bytes_of(model)
    if gradient_bytes is None and param_bytes is not None:
        gradient_bytes = param_bytes  # every parameter trainable, unless said otherwise
    unit_bytes = None
    if model is not None and hasattr(model, "parameters"):  # a torch module: its sharding units
        if param_bytes is None:
            param_bytes = sum(int(p.numel()) * int(p.element_size()) for p in model.parameters())
        unit_bytes = unit_bytes_of(model) or None
    launch = _launch(env)
    if prefer is None:
        prefer = env.get("RESILIENT_STRATEGY_PREFER") or None
        if prefer is not None and prefer not in BACKENDS:
            raise InvalidOptionError(
                f"RESILIENT_STRATEGY_PREFER={shown(prefer)}: expected one of {BACKENDS}",
                "RESILIENT_STRATEGY_PREFER")
    extra_rules: list[str | Path | Rule] = [*_env_rules(env)]
    extra_rules += list(rules)
    disabled = [*_env_disabled_rules(env, extra_rules), *disable_rules]
    # the user's signature and remedy files: a bad one fails here, named by its variable
    _named(env, "RESILIENT_STRATEGY_SIGNATURES", lambda: signatures_from_env(env, os.pathsep))
    remedies = _named(env, REMEDIES_VAR,
                      lambda: load_remedies(_env_list(env, REMEDIES_VAR, os.pathsep)))
    # a rehearsed probe fault: a typo is refused here, never a rehearsal that injects nothing
    parse_probe_fault(env.get(PROBE_FAULT_VAR, ""))
    # The logical-CPU test mode proves nothing about this machine's GPUs: keep it out of the cache.
    use_cache = cache and env_flag(env, "RESILIENT_STRATEGY_CACHE", True) and not logical_cpus
    cluster = parse_tf_config(env.get(TF_CONFIG_VAR)) if fw == "tensorflow" else None
    workers = cluster.num_workers if cluster is not None and cluster.multi_worker else 1
    worker_rank = (cluster.worker_rank or 0) if cluster is not None and cluster.multi_worker \
        else 0
    return Options(
        framework=fw,
        global_batch_size=global_batch_size,
        devices=None if devices is None else tuple(int(d) for d in devices),
        prefer=prefer,
        gradient_bytes=gradient_bytes,
        sample_seconds=sample_seconds,
        max_per_replica_batch=max_per_replica_batch,
        rank=launch.rank,
        local_rank=launch.local_rank,
        world_size=launch.world_size,
        local_world_size=launch.local_world_size,
        user_env=tuple(sorted(env)),
        logical_cpus=logical_cpus,
        tf_workers=workers,
        tf_worker_rank=worker_rank,
        tf_task=cluster.task if cluster is not None else "",
        probe=str(probe),
        timeout_s=float(timeout),
        budget_s=4 * float(timeout),
        process_group_timeout=float(group_timeout),
        dry_run=dry_run,
        cache_dir=(Path(cache_dir) if cache_dir else default_dir(env)) if use_cache else None,
        cache_ttl_s=DEFAULT_TTL_S if cache_ttl is None else float(cache_ttl),
        rules=load_rules(extra_rules, disabled),
        precision=precision,
        framework_reason=why,
        quiet=quiet,
        remedies=remedies,
        sharding=sharding,
        offload=offload,
        param_bytes=param_bytes,
        optimizer_state_factor=DEFAULT_OPTIMIZER_STATE_FACTOR if optimizer_state_factor is None
        else optimizer_state_factor,
        shard_unit_bytes=unit_bytes,
        checkpoint_async=env_flag(env, CHECKPOINT_ASYNC_VAR, True),
    )



def run_options_from(env: Mapping[str, str], *, script: str, script_args: tuple[str, ...],
                     framework: str | None, nproc: str, max_relaunches: int | None,
                     stall_timeout: float | None, global_batch_size: int | None,
                     gradient_bytes: int | None, probe_timeout: float | None, logical_cpus: int,
                     torchrun: Any = None, sharding: str | None = None,
                     param_bytes: int | None = None, optimizer_state_factor: float | None = None,
                     offload: str | None = None,
                     busy_timeout: float | None = None,
                     warm_start: bool | None = None,
                     measured_switch: bool | None = None) -> RunOptions:
    """The supervisor's options: the command line > RESILIENT_STRATEGY_STALL_TIMEOUT /
    RESILIENT_STRATEGY_MAX_RELAUNCHES / RESILIENT_STRATEGY_WARM_START /
    RESILIENT_STRATEGY_MEASURED_SWITCH > our defaults.
    ``nproc``: a count or "auto"."""
    if nproc in ("auto", "gpu"):
        count: int | None = None
    else:
        try:
            count = int(nproc)
        except ValueError:
            raise InvalidOptionError(
                f"--nproc-per-node must be a number or 'auto', not {nproc!r}",
                "--nproc-per-node") from None
    if stall_timeout is None and env.get("RESILIENT_STRATEGY_STALL_TIMEOUT"):
        stall_timeout = _env_seconds(env, "RESILIENT_STRATEGY_STALL_TIMEOUT", MIN_STALL_S,
                                     MAX_STALL_TIMEOUT_S)
    check_environment(env)
    if max_relaunches is None:
        max_relaunches = _env_int(env, "RESILIENT_STRATEGY_MAX_RELAUNCHES", None)
        if max_relaunches is not None and not 0 <= max_relaunches <= MAX_RELAUNCHES:
            raise InvalidOptionError(
                f"RESILIENT_STRATEGY_MAX_RELAUNCHES={env['RESILIENT_STRATEGY_MAX_RELAUNCHES']!r}: "
                f"expected an integer from 0 to {MAX_RELAUNCHES}",
                "RESILIENT_STRATEGY_MAX_RELAUNCHES")
    if warm_start is None:
        warm_start = env_flag(env, WARM_START_VAR, DEFAULT_WARM_START)
    if measured_switch is None:
        measured_switch = env_flag(env, MEASURED_SWITCH_VAR, DEFAULT_MEASURED_SWITCH)
    return RunOptions(
        script=script, script_args=script_args, framework=framework, nproc=count,
        max_relaunches=max_relaunches, stall_timeout_s=stall_timeout,
        global_batch_size=global_batch_size, gradient_bytes=gradient_bytes,
        probe_timeout_s=probe_timeout, logical_cpus=logical_cpus, torchrun=torchrun,
        sharding=sharding, param_bytes=param_bytes, optimizer_state_factor=optimizer_state_factor,
        offload=offload, busy_timeout_s=busy_timeout, warm_start=warm_start,
        measured_switch=measured_switch)


