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
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from ...errors import FrameworkNotInstalledError, InvalidOptionError, InvalidRuleError
from ...vocab import (
    FRAMEWORK_ALIASES,
    FRAMEWORKS,
)
from ..knowledge.remedies import ENV_VAR as REMEDIES_VAR
from ..knowledge.remedies import Remedies, load_remedies
from ..knowledge.rules import Rule, load_rules
from ..knowledge.signatures import signatures_from_env
from ..values.facts import Facts
from ..values.tfcluster import VAR as TF_CONFIG_VAR
from ..values.tfcluster import parse_tf_config
from .fields import CALL, RUN, shown
from .model import gradient_bytes_of, unit_bytes_of
from .options import (
    CHECKPOINT_ASYNC_VAR,
    MAX_WORLD_SIZE,
    Launch,
    Options,
    RunOptions,
    default_dir,
)
from .probe_fault import PROBE_FAULT_VAR, parse_probe_fault


def _env_list(env: Mapping[str, str], name: str, sep: str = ",") -> list[str]:
    return [x.strip() for x in env.get(name, "").split(sep) if x.strip()]


#: ``resilient-strategy run``'s warm start of its workers (``--warm-start``), on or off.
WARM_START_VAR = RUN["warm_start"].env
#: ``resilient-strategy run``'s measured switch (``--measured-switch``), on or off.
MEASURED_SWITCH_VAR = RUN["measured_switch"].env
#: The library's on/off variables: 1 or 0 (true / false too); empty is unset.
FLAG_VARS = (CALL["cache"].env, "RESILIENT_STRATEGY_FORKSERVER", CHECKPOINT_ASYNC_VAR,
             WARM_START_VAR, MEASURED_SWITCH_VAR)
#: The library's variables that name files or directories (several, for RULES).
PATH_VARS = (CALL["cache_dir"].env, CALL["rules"].env,
             "RESILIENT_STRATEGY_DECISION", "RESILIENT_STRATEGY_PROGRESS",
             "RESILIENT_STRATEGY_SIGNATURES", "RESILIENT_STRATEGY_REMEDIES")
MAX_PATH_CHARS = 4096
_TRUE, _FALSE = ("1", "true"), ("0", "false")


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
    name = CALL["rules"].env
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
    name = CALL["disable_rules"].env
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


def _d(name: str) -> Any:
    """The keyword's default, from its field (`fields.CALL`)."""
    return CALL[name].default


@dataclass(frozen=True)
class TrainingArgs:
    """What trains: the framework, the global batch, the devices, precision, the training
    collectives' timeout and sharding."""

    framework: str | None = _d("framework")
    global_batch_size: int | None = _d("global_batch_size")
    devices: Sequence[int] | None = _d("devices")
    precision: str = _d("precision")
    logical_cpus: int = _d("logical_cpus")
    process_group_timeout: float | None = _d("process_group_timeout")
    sharding: str = _d("sharding")
    offload: str = _d("offload")


@dataclass(frozen=True)
class ModelArgs:
    """How big the model is: for the cost model and memory planning."""

    model: Any = field(default=_d("model"), compare=False)
    gradient_bytes: int | None = _d("gradient_bytes")
    param_bytes: int | None = _d("param_bytes")
    optimizer_state_factor: float | None = _d("optimizer_state_factor")
    sample_seconds: float | None = _d("sample_seconds")
    max_per_replica_batch: int | None = _d("max_per_replica_batch")


@dataclass(frozen=True)
class ProbingArgs:
    """How to prove: probe mode, the probe timeout, a preferred backend, dry run, quiet."""

    probe: str | bool | None = _d("probe")
    timeout: float | None = _d("timeout")
    prefer: str | None = _d("prefer")
    dry_run: bool = _d("dry_run")
    quiet: bool | None = _d("quiet")


@dataclass(frozen=True)
class CacheArgs:
    """Where proofs are kept."""

    cache: bool = _d("cache")
    cache_dir: str | Path | None = _d("cache_dir")  # noqa: RUF009 (None)
    cache_ttl: float | None = _d("cache_ttl")


@dataclass(frozen=True)
class RuleArgs:
    """The user's known-issue rules, and the built-in ones they turn off."""

    rules: Sequence[str | Path | Rule] = _d("rules")
    disable_rules: Sequence[str] = _d("disable_rules")


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
    """Validate every argument once; environment variables fill what was not passed (each
    option's variable and our default: its `fields.CALL` field)."""
    t, m, pr, c = arguments.training, arguments.model, arguments.probing, arguments.cache
    check_environment(env)
    _check_kinds(t, c)
    timeout = _number("timeout", pr.timeout)
    cache_ttl = _number("cache_ttl", c.cache_ttl)
    sample_seconds = _number("sample_seconds", m.sample_seconds)
    group_timeout = _number("process_group_timeout", t.process_group_timeout)
    fw, why = _pick_framework(t.framework, facts)
    probe = CALL["probe"].given(pr.probe, env)
    quiet = CALL["quiet"].given(pr.quiet, env)
    probe = "auto" if probe is True else "never" if probe is False else probe
    timeout = CALL["timeout"].given(timeout, env)
    group_timeout = CALL["process_group_timeout"].given(group_timeout, env)
    gradient_bytes, param_bytes, unit_bytes = _model_sizes(m)
    launch = _launch(env)
    prefer = CALL["prefer"].given(pr.prefer, env)
    rules, remedies = _rules_and_remedies(env, arguments.rules)
    # a rehearsed probe fault: a typo is refused here, never a rehearsal that injects nothing
    parse_probe_fault(env.get(PROBE_FAULT_VAR, ""))
    # The logical-CPU test mode proves nothing about this machine's GPUs: keep it out of the cache.
    use_cache = c.cache and env_flag(env, CALL["cache"].env, True) and not t.logical_cpus
    cluster = parse_tf_config(env.get(TF_CONFIG_VAR)) if fw == "tensorflow" else None
    multi = cluster is not None and cluster.multi_worker
    return Options(
        framework=fw,
        global_batch_size=t.global_batch_size,
        devices=None if t.devices is None else tuple(int(d) for d in t.devices),
        prefer=prefer,
        gradient_bytes=gradient_bytes,
        sample_seconds=sample_seconds,
        max_per_replica_batch=m.max_per_replica_batch,
        rank=launch.rank,
        local_rank=launch.local_rank,
        world_size=launch.world_size,
        local_world_size=launch.local_world_size,
        user_env=tuple(sorted(env)),
        logical_cpus=t.logical_cpus,
        tf_workers=cluster.num_workers if cluster is not None and multi else 1,
        tf_worker_rank=(cluster.worker_rank or 0) if cluster is not None and multi else 0,
        tf_task=cluster.task if cluster is not None else "",
        probe=str(probe),
        timeout_s=float(timeout),
        budget_s=4 * float(timeout),
        process_group_timeout=float(group_timeout),
        dry_run=pr.dry_run,
        cache_dir=(Path(c.cache_dir) if c.cache_dir else default_dir(env)) if use_cache else None,
        cache_ttl_s=CALL["cache_ttl"].fallback if cache_ttl is None else float(cache_ttl),
        rules=rules,
        precision=t.precision,
        framework_reason=why,
        quiet=quiet,
        remedies=remedies,
        sharding=t.sharding,
        offload=t.offload,
        param_bytes=param_bytes,
        optimizer_state_factor=CALL["optimizer_state_factor"].given(m.optimizer_state_factor, {}),
        shard_unit_bytes=unit_bytes,
        checkpoint_async=env_flag(env, CHECKPOINT_ASYNC_VAR, True),
    )


def _check_kinds(t: TrainingArgs, c: CacheArgs) -> None:
    """The arguments whose kind no range check of `Options` can judge: the framework's name,
    the devices (a sequence of integers) and the cache directory (a path)."""
    if t.framework is not None and not isinstance(t.framework, str):
        raise InvalidOptionError(
            f"framework must be 'torch' or 'tensorflow', not {t.framework!r}", "framework")
    devices = t.devices
    if devices is not None and (isinstance(devices, (str, bytes)) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in _iterable("devices", devices)
    )):
        raise InvalidOptionError(
            f"devices must be a sequence of GPU indices (ints), not {devices!r}", "devices")
    if c.cache_dir is not None and not isinstance(c.cache_dir, (str, os.PathLike)):
        raise InvalidOptionError(
            f"cache_dir must be a path (str or os.PathLike), not {c.cache_dir!r}", "cache_dir")


def _model_sizes(m: ModelArgs) -> tuple[int | None, int | None, int | None]:
    """The gradient bytes, the parameter bytes and the largest sharding unit's bytes: as given,
    else read from the model (a torch module: its parameters and its units)."""
    model, gradient_bytes, param_bytes = m.model, m.gradient_bytes, m.param_bytes
    if model is not None and gradient_bytes is None:
        gradient_bytes = gradient_bytes_of(model)
    if gradient_bytes is None and param_bytes is not None:
        gradient_bytes = param_bytes  # every parameter trainable, unless said otherwise
    unit_bytes = None
    if model is not None and hasattr(model, "parameters"):  # a torch module: its sharding units
        if param_bytes is None:
            param_bytes = sum(int(p.numel()) * int(p.element_size()) for p in model.parameters())
        unit_bytes = unit_bytes_of(model) or None
    return gradient_bytes, param_bytes, unit_bytes


def _rules_and_remedies(env: Mapping[str, str], given: RuleArgs
                        ) -> tuple[tuple[Rule, ...], Remedies]:
    """The rules (the variable's files, then the call's; less the ids turned off, the
    variable's and the call's) and the remedies; the user's signature and remedy files are
    read here too, so that a bad one fails now, named by its variable."""
    rules, disable_rules = given.rules, given.disable_rules
    if isinstance(rules, (str, Path)):  # one file, not a sequence of characters
        rules = (rules,)
    if isinstance(disable_rules, str):
        disable_rules = (disable_rules,)
    extra_rules: list[str | Path | Rule] = [*_env_rules(env)]
    extra_rules += list(rules)
    disabled = [*_env_disabled_rules(env, extra_rules), *disable_rules]
    _named(env, "RESILIENT_STRATEGY_SIGNATURES", lambda: signatures_from_env(env, os.pathsep))
    remedies = _named(env, REMEDIES_VAR,
                      lambda: load_remedies(_env_list(env, REMEDIES_VAR, os.pathsep)))
    return tuple(load_rules(extra_rules, disabled)), remedies


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
    # each flag not given: its variable, then our default (its `fields.RUN` field)
    stall_timeout = RUN["stall_timeout"].given(stall_timeout, env)
    check_environment(env)
    max_relaunches = RUN["max_relaunches"].given(max_relaunches, env)
    warm_start = RUN["warm_start"].given(warm_start, env)
    measured_switch = RUN["measured_switch"].given(measured_switch, env)
    return RunOptions(
        script=script, script_args=script_args, framework=framework, nproc=count,
        max_relaunches=max_relaunches, stall_timeout_s=stall_timeout,
        global_batch_size=global_batch_size, gradient_bytes=gradient_bytes,
        probe_timeout_s=probe_timeout, logical_cpus=logical_cpus, torchrun=torchrun,
        sharding=sharding, param_bytes=param_bytes, optimizer_state_factor=optimizer_state_factor,
        offload=offload, busy_timeout_s=busy_timeout, warm_start=warm_start,
        measured_switch=measured_switch)


