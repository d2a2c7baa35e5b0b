"""Every option, described once: one frozen `OptionField` per option (its name, type, range,
default, environment variable and help), in two tables, `CALL_FIELDS` (``resilient_strategy()``'s
keywords) and `RUN_FIELDS` (``resilient-strategy run``'s own flags).

What is derived from them: the range check (`OptionField.expected`, called by `Options` and
`RunOptions`), the environment reading (`OptionField.from_env`, called by `arguments`), run's
command-line flags (`OptionField.add_to`, called by `run/cmdline`) and the options tables of
the reference docs (`reference_table`, rendered by ``python docs/gen_options.py``);
``tests/test_options_described_once.py`` fails when any of them disagrees with the fields.
An option keeps its one name from the user to its use: the keyword (``timeout``), the flag
(``--stall-timeout``, its dashes for underscores) and the value's field (``timeout_s``,
``stall_timeout_s``: the name with its unit, `OptionField.unit`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ...errors import InvalidOptionError
from ...vocab import BACKENDS, FRAMEWORKS, OFFLOAD_MODES, PRECISIONS, PROBE_MODES, SHARDING_MODES

# ----- ranges (inclusive upper bounds) and defaults ------------------------------------------
DEFAULT_TIMEOUT_S = 30.0
#: Collective timeout of the training process group. Not the probe's 30 s: a rank may rightly
#: wait minutes for a peer that checkpoints or evaluates; not torch's 10 minutes either.
DEFAULT_PROCESS_GROUP_TIMEOUT = 300.0
MAX_TIMEOUT_S = 3600.0  # one probe
MAX_PROCESS_GROUP_TIMEOUT = 7 * 86400.0  # a training collective: a week (timedelta and NCCL take it)
MAX_CACHE_TTL_S = 366 * 86400.0
MAX_SAMPLE_SECONDS = 3600.0
#: Batch sizes fit a 32-bit integer; beyond, the divisor search of the batch split would take
#: minutes for nothing a DataLoader could feed.
MAX_BATCH = 2**31 - 1
MAX_GRADIENT_BYTES = 2**50  # a pebibyte of gradients
MAX_LOGICAL_CPUS = 1024
MAX_WORLD_SIZE = 2**20
MAX_OPTIMIZER_STATE_FACTOR = 64.0
#: AdamW: two fp32 moments per trainable parameter (SGD with momentum: 1; plain SGD: 0).
DEFAULT_OPTIMIZER_STATE_FACTOR = 2.0
DEFAULT_TTL_S = 7 * 24 * 3600.0
MAX_STALL_TIMEOUT_S = 7 * 86400.0
MAX_RELAUNCHES = 1000
#: The default fault-rate window of ``resilient-strategy run`` (optimizer steps), and its bound.
DEFAULT_FAULT_WINDOW = 100
MAX_FAULT_WINDOW = 1_000_000_000
#: Whether ``resilient-strategy run`` starts a torch job's workers warm by default: yes, measured
#: faster (benchmarks/results/warm-restart-cpu-2026-11-27.md: a restart 9.24 s cold, 0.79 s warm).
DEFAULT_WARM_START = True
#: ``resilient-strategy run`` acts on a measured "another candidate is clearly faster" (issue 41
#: item 4): a trial of it at a checkpoint, the faster one kept.
DEFAULT_MEASURED_SWITCH = True
DEFAULT_MIN_THROUGHPUT = 0.25
DEFAULT_MAX_ATTEMPTS_WITHOUT_PROGRESS = 3
DEFAULT_EVIDENCE_DIR = "resilient-strategy-evidence"

#: What an option holds, and so how it is checked, read from the environment and parsed:
#: ``integer`` (a whole number in [low, high]), ``seconds`` (a number of seconds in (0, high]),
#: ``number`` (a number in [low, high]), ``choice`` (one of ``choices``), ``switch`` (True or
#: False; on the command line a flag that turns it on), ``onoff`` (True, False or None: not
#: given; ``--x`` / ``--no-x``; 1 or 0 in the environment), ``text`` (a path or a name) and
#: ``value`` (checked by the code that reads it: a model, GPU indices, rule files).
Kind = Literal["integer", "seconds", "number", "choice", "switch", "onoff", "text", "value"]
_TRUE, _FALSE = ("1", "true"), ("0", "false")


def shown(text: str, limit: int = 120) -> str:
    """What the user typed, quoted and cut to ``limit`` characters, for an error line."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} chars)"


@dataclass(frozen=True)
class OptionField:
    """One option, described once (see the module docstring)."""

    name: str
    """The user's name: ``resilient_strategy()``'s keyword, or run's flag with underscores."""
    kind: Kind
    help: str
    """What it does, in words (the command line's help and the reference docs' row)."""
    default: Any = None
    """The keyword's or the flag's default (None: not given, the environment or `fallback`)."""
    fallback: Any = None
    """Our default where neither the user nor the environment gives one (None: `default`)."""
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    env: str = ""
    """The environment variable read when the option is not given ("" none)."""
    unit: str = ""
    """The suffix of the value's field: ``timeout`` is ``Options.timeout_s``."""
    blank_unset: bool = False
    """An empty variable is unset (else it is a value, and refused when it is not one)."""
    default_words: str = ""
    """The default in words, where it is computed rather than a value."""
    run: bool = False
    """One of ``resilient-strategy run``'s flags (else a keyword of ``resilient_strategy()``)."""

    @property
    def field(self) -> str:
        """The name of the validated value's field (`Options`, `RunOptions`)."""
        return self.name + self.unit

    @property
    def flag(self) -> str:
        """The command-line flag (``--stall-timeout``); "" for a keyword."""
        return "--" + self.name.replace("_", "-") if self.run else ""

    @property
    def label(self) -> str:
        """How an error names the option: the flag, else the keyword."""
        return self.flag or self.name

    def range_words(self) -> str:
        """The range in words ("" when the reading code checks it)."""
        if self.kind == "integer":
            return f"{_whole(self.low)} to {_whole(self.high)}"
        if self.kind == "seconds":
            assert self.high is not None
            if self.high >= 86400 and self.high % 86400 == 0:
                return f"(0, {self.high / 86400:g} days]"
            return f"(0, {self.high:g}] s"
        if self.kind == "number":
            return f"{self.low:g} to {self.high:g}"
        if self.kind == "choice":
            return " / ".join(self.choices)
        if self.kind in ("switch", "onoff"):
            return "on / off"
        return ""

    def expected(self, value: object, none_ok: bool = True) -> str | None:
        """What ``value`` should have been, in words; None where it is in range (None itself is
        in range, not given, where ``none_ok``)."""
        if value is None and none_ok:
            return None
        number = None if isinstance(value, bool) or not isinstance(value, (int, float)) \
            else float(value)
        low = -math.inf if self.low is None else self.low
        high = math.inf if self.high is None else self.high
        if self.kind == "integer":
            if number is None or not isinstance(value, int) or not low <= value <= high:
                return (f"a positive integer (at most {_whole(high)})" if low == 1
                        else f"an integer from {_whole(low)} to {_whole(high)}")
        elif self.kind == "seconds":
            if number is None or not (math.isfinite(number) and 0 < number <= high):
                return f"a number of seconds in (0, {high:g}]"
        elif self.kind == "number":
            if number is None or not (math.isfinite(number) and low <= number <= high):
                return f"a number from {low:g} to {high:g}"
        elif self.kind == "choice":
            if value not in self.choices:
                return f"one of {self.choices}"
        elif self.kind in ("switch", "onoff") and not isinstance(value, bool):
            return "True or False"
        return None

    def check(self, value: object, label: str | None = None, *, none_ok: bool = True) -> None:
        """``value`` in range, else an `InvalidOptionError` naming ``label`` (the option)."""
        want = self.expected(value, none_ok)
        if want is not None:
            name = label or self.label
            raise InvalidOptionError(f"{name} must be {want}, not {value!r}", name)

    def from_env(self, env: Mapping[str, str]) -> Any:
        """The value `env` gives (None: the variable is unset, or empty where `blank_unset`;
        an on/off one is unset when blank); a value it cannot use is an `InvalidOptionError`
        naming the variable and what it holds."""
        if not self.env or self.env not in env:
            return None
        text = env[self.env]
        if self.kind in ("switch", "onoff"):
            word = text.strip().lower()
            if not word:
                return None
            if word not in (*_TRUE, *_FALSE):
                raise InvalidOptionError(f"{self.env}={shown(text)}: expected 1 or 0", self.env)
            return word in _TRUE
        if self.blank_unset and text == "":
            return None
        value: Any = text
        if self.kind == "integer":
            try:
                value = int(text)
            except ValueError:
                value = math.nan  # not an integer: refused below, with the range
        elif self.kind in ("seconds", "number"):
            try:
                value = float(text)
            except ValueError:
                value = math.nan
        want = self.expected(value)
        if want is not None:
            raise InvalidOptionError(f"{self.env}={shown(text)}: expected {want}", self.env)
        return value

    def given(self, value: Any, env: Mapping[str, str]) -> Any:
        """Explicit argument > the user's environment > our default."""
        if value is not None:
            return value
        read = self.from_env(env)
        return read if read is not None else self.fallback

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """This option's flag on ``parser`` (run's), its help and default from the field."""
        said = self.default_text().replace("`", "") + (f"; {self.env}" if self.env else "")
        text = f"{self.help} (default: {said})".replace("%", "%%")  # argparse formats help
        kw: dict[str, Any] = {"default": self.default, "help": text}
        if self.kind == "integer":
            kw["type"] = int
        elif self.kind in ("seconds", "number"):
            kw["type"] = float
        elif self.kind == "choice":
            kw["choices"] = self.choices
        elif self.kind == "switch":
            kw["action"] = "store_true"
        elif self.kind == "onoff":
            kw["action"] = argparse.BooleanOptionalAction
        parser.add_argument(self.flag, **kw)

    def default_text(self) -> str:
        """The default, for the reference docs."""
        if self.default_words:
            return self.default_words
        value = self.fallback if self.fallback is not None else self.default
        if isinstance(value, bool):
            return "on" if value else "off"
        if value is None or value == ():
            return "none"
        if isinstance(value, str):
            return f"`{value}`"
        return f"{value:g} s" if self.kind == "seconds" else f"{value:g}"


def _whole(bound: float | None) -> str:
    """An integer bound as written (2147483647, never 2.14748e+09)."""
    return "unbounded" if bound is None or math.isinf(bound) else str(int(bound))


_F = OptionField

#: ``resilient_strategy()``'s options, in its signature's order (``env`` and ``facts`` are no
#: options: what to decide on, not how).
CALL_FIELDS: tuple[OptionField, ...] = (
    _F("framework", "choice", "the framework the script trains with", choices=FRAMEWORKS,
       default_words="the one imported, else the one installed"),
    _F("global_batch_size", "integer", "samples per optimizer step; kept exact on every "
       "fallback", low=1, high=MAX_BATCH, default_words="none (the per-device batch stays yours)"),
    _F("devices", "value", "GPU indices (as the job sees them) to consider",
       default_words="every GPU the job can see"),
    _F("probe", "choice", "auto: probe unless cached; force: probe again; never: trust the plan "
       "(True: auto, False: never)", choices=PROBE_MODES, env="RESILIENT_STRATEGY_PROBE",
       fallback="auto"),
    _F("timeout", "seconds", "seconds per probe (the whole decision is bounded by 4x this)",
       high=MAX_TIMEOUT_S, env="RESILIENT_STRATEGY_TIMEOUT", unit="_s",
       fallback=DEFAULT_TIMEOUT_S),
    _F("prefer", "choice", "a backend to try first when it works", choices=BACKENDS,
       env="RESILIENT_STRATEGY_PREFER", blank_unset=True, default_words="by speed"),
    _F("dry_run", "switch", "decide without probing, setting variables or building anything",
       default=False),
    _F("model", "value", "the model (its gradient size ranks the strategies by speed, its "
       "parameters plan the memory)", default_words="unknown"),
    _F("gradient_bytes", "integer", "the model's gradient bytes, when the model does not exist "
       "yet", low=1, high=MAX_GRADIENT_BYTES, default_words="from model=, else unknown"),
    _F("sample_seconds", "seconds", "the measured compute of one sample on one device (only "
       "with it may fewer GPUs rank above NCCL proven on every GPU)", high=MAX_SAMPLE_SECONDS,
       default_words="unknown: the ranking is provisional"),
    _F("max_per_replica_batch", "integer", "the largest batch one replica may take (more "
       "accumulates)", low=1, high=MAX_BATCH, default_words="the best plan's"),
    _F("rules", "value", "extra rule files (TOML, os.pathsep between in the variable) or Rule "
       "values", default=(), env="RESILIENT_STRATEGY_RULES", default_words="the built-in ones"),
    _F("disable_rules", "value", "rule ids to switch off (commas between in the variable)",
       default=(), env="RESILIENT_STRATEGY_DISABLE_RULES"),
    _F("cache", "switch", "read and write the decision cache (RESILIENT_STRATEGY_CACHE=0: off)",
       default=True, env="RESILIENT_STRATEGY_CACHE"),
    _F("cache_dir", "text", "where the cache lives", env="RESILIENT_STRATEGY_CACHE_DIR",
       default_words="`$XDG_CACHE_HOME/resilient_strategy`, else `~/.cache/resilient_strategy`"),
    _F("cache_ttl", "seconds", "seconds a cached result stays valid", high=MAX_CACHE_TTL_S,
       unit="_s", fallback=DEFAULT_TTL_S, default_words="7 days"),
    _F("precision", "choice", "PyTorch's training precision (auto: bf16 from compute "
       "capability 8.0, fp16 with a GradScaler on 7.x)", choices=PRECISIONS, default="auto"),
    _F("process_group_timeout", "seconds", "seconds a training collective may wait for a peer "
       "before the process group fails (PyTorch; TensorFlow's across TF_CONFIG workers)",
       high=MAX_PROCESS_GROUP_TIMEOUT, env="RESILIENT_STRATEGY_PG_TIMEOUT",
       fallback=DEFAULT_PROCESS_GROUP_TIMEOUT),
    _F("logical_cpus", "integer", "TensorFlow on N logical CPU devices instead of GPUs (a test "
       "mode, never cached)", default=0, low=0, high=MAX_LOGICAL_CPUS),
    _F("quiet", "onoff", "True: no progress line per probe on stderr; False: one even when "
       "stderr is not a terminal", env="RESILIENT_STRATEGY_QUIET",
       default_words="none: a line when stderr is a terminal"),
    _F("sharding", "choice", "shard the model over the replicas (PyTorch FSDP2): auto only when "
       "a replica does not fit the GPUs' free memory, full always, none never",
       choices=SHARDING_MODES, default="auto"),
    _F("offload", "choice", "PyTorch FSDP2 CPUOffloadPolicy: auto moves a sharded model's state "
       "to host memory only where nothing that keeps it on the GPUs fits", choices=OFFLOAD_MODES,
       default="none"),
    _F("param_bytes", "integer", "the model's parameter bytes, for memory planning (candidates "
       "whose state does not fit their devices are ruled out)", low=1, high=MAX_GRADIENT_BYTES,
       default_words="from model=, else unknown"),
    _F("optimizer_state_factor", "number", "the optimizer's state per gradient byte (AdamW: 2, "
       "SGD with momentum: 1), for the same memory planning", low=0,
       high=MAX_OPTIMIZER_STATE_FACTOR, fallback=DEFAULT_OPTIMIZER_STATE_FACTOR),
)


def _R(name: str, kind: Kind, help: str, **kw: Any) -> OptionField:
    return OptionField(name, kind, help, run=True, **kw)


#: ``resilient-strategy run``'s own flags, in its ``--help`` order (torchrun's are its own).
RUN_FIELDS: tuple[OptionField, ...] = (
    _R("max_relaunches", "integer", "relaunches at most, retries included (without a count, "
       "the candidates and --max-attempts-without-progress bound them)", low=0,
       high=MAX_RELAUNCHES, env="RESILIENT_STRATEGY_MAX_RELAUNCHES", default_words="no count"),
    _R("min_throughput", "number", "never step down to a candidate estimated below this "
       "fraction of the throughput of the one that failed (0: any)",
       default=DEFAULT_MIN_THROUGHPUT, low=0, high=1),
    _R("allow_cpu", "switch", "a GPU job may step down to the CPU (refused by default)",
       default=False),
    _R("max_attempts_without_progress", "integer", "stop after this many attempts in a row that "
       "get no further than the furthest step reached before (the crash-loop bound)",
       default=DEFAULT_MAX_ATTEMPTS_WITHOUT_PROGRESS, low=1, high=MAX_RELAUNCHES),
    _R("fault_window", "integer", "optimizer steps: a second fault on a strategy within this "
       "many steps of the one before steps down; a communication error (a backend verdict) "
       "this many steps or more after the last fault is retried first", default=DEFAULT_FAULT_WINDOW,
       low=1, high=MAX_FAULT_WINDOW),
    _R("evidence_dir", "text", "where each fault's per-rank tracebacks and the attempts record "
       "go", default=DEFAULT_EVIDENCE_DIR),
    _R("stall_timeout", "seconds", "seconds the ranks may wait on one that makes no progress "
       "(stopped, hung, or in a collective that never completes) before a stall is declared",
       high=MAX_STALL_TIMEOUT_S, env="RESILIENT_STRATEGY_STALL_TIMEOUT", unit="_s",
       blank_unset=True, default_words="max(15 s, 5 x the p99 step time), at most 600 s"),
    _R("busy_timeout", "seconds", "seconds a rank busy in the script's own code (its CPU time "
       "advancing: validation, checkpointing) may keep the others waiting",
       high=MAX_STALL_TIMEOUT_S, unit="_s", default_words="600 s"),
    _R("framework", "choice", "the script's framework", choices=FRAMEWORKS,
       default_words="read from the script"),
    _R("global_batch_size", "integer", "for ranking the candidates (the script's own value is "
       "used in training, and must agree)", low=1, high=MAX_BATCH, default_words="the script's"),
    _R("gradient_bytes", "integer", "the model's gradient bytes, for ranking the candidates",
       low=1, high=MAX_GRADIENT_BYTES, default_words="unknown"),
    _R("probe_timeout", "seconds", "seconds per probe", high=MAX_TIMEOUT_S, unit="_s",
       fallback=DEFAULT_TIMEOUT_S),
    _R("sharding", "choice", "shard the model (FSDP2): auto when a replica does not fit, full, "
       "none; as the script's resilient_strategy(sharding=), which must agree with it",
       choices=SHARDING_MODES, default_words="`auto`"),
    _R("offload", "choice", "CPU offload of a sharded model's state: none, auto (only where "
       "nothing that keeps it on the GPUs fits); as the script's resilient_strategy(offload=), "
       "which must agree with it", choices=OFFLOAD_MODES, default_words="`none`"),
    _R("param_bytes", "integer", "the model's parameter bytes, for memory planning", low=1,
       high=MAX_GRADIENT_BYTES, default_words="unknown"),
    _R("optimizer_state_factor", "number", "optimizer state per gradient byte (AdamW: 2)",
       low=0, high=MAX_OPTIMIZER_STATE_FACTOR, fallback=DEFAULT_OPTIMIZER_STATE_FACTOR),
    _R("warm_start", "onoff", "fork a torch job's workers, every attempt's, from one server that "
       "imported torch once, so that a relaunch does not import torch again (--no-warm-start: "
       "fresh interpreters)", env="RESILIENT_STRATEGY_WARM_START", fallback=DEFAULT_WARM_START),
    _R("measured_switch", "onoff", "when rank 0 measures another candidate, proven here, "
       "clearly faster (by more than 10%), stop at the first checkpoint at or after the "
       "measurement, try it with the same global batch, resumed from it, and keep the faster "
       "one, never a slower one (--no-measured-switch: the measurement is only told, in a line "
       "and attempts.json)", env="RESILIENT_STRATEGY_MEASURED_SWITCH",
       fallback=DEFAULT_MEASURED_SWITCH),
    _R("logical_cpus", "integer", "TensorFlow test mode: plan for N logical CPU devices (the "
       "script passes logical_cpus=N too)", default=0, low=0, high=MAX_LOGICAL_CPUS),
)

CALL: Mapping[str, OptionField] = {f.name: f for f in CALL_FIELDS}
RUN: Mapping[str, OptionField] = {f.name: f for f in RUN_FIELDS}


def reference_table(fields: Sequence[OptionField]) -> str:
    """The reference docs' table of ``fields``, one row each (Markdown)."""
    run = any(f.run for f in fields)
    rows = [f"| {'flag' if run else 'argument'} | range | default | environment variable | what |",
            "|---|---|---|---|---|"]
    for f in fields:
        name = f"`{f.flag}`" if run else f"`{f.name}`"
        if f.kind == "onoff" and run:
            name += f", `--no-{f.flag[2:]}`"
        rows.append(f"| {name} | {f.range_words()} | {f.default_text()} | "
                    f"{f'`{f.env}`' if f.env else ''} | {f.help} |")
    return "\n".join(rows) + "\n"
