"""What a user sees while and after deciding: the progress line per probe, the fallback warning,
and the check of a probe timeout against the start-up a probe needs on this machine.

Pure where it can be: `fallback_warning` and `startup_floor` take data and return
text or numbers; `ProgressLine` writes to a stream it is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TextIO

from ..core.knowledge.causes import what_and_fix
from ..core.measures.probe import OK, TIMEOUT, ProbeResult, judged_hang, telling_line
from ..core.values.human import compose

if TYPE_CHECKING:
    from ..core.call.options import Options
    from ..core.planning.plan import Plan
    from ..core.values.candidate import Candidate
    from ..core.values.facts import Facts

#: A probe's cold start (spawn the workers, import the framework, initialize, first collective)
#: when no probe on this machine has been measured yet: torch ~3 s on 2 CPU processes over gloo
#: (measured here, cold), ~6-8 s for NCCL on 2 GPUs (field notes); TensorFlow imports slower.
TYPICAL_STARTUP_S = {"torch": 3.0, "tensorflow": 5.0}
#: The most characters of the fallback warning's line (the trace has the whole story).
FALLBACK_CHARS = 240
#: The most characters of the failing process's line quoted in it (no signature placed it).
QUOTE_CHARS = 100
#: What ends the fallback warning: where the whole story is.
FALLBACK_WHY = ". Why: sel.explain()"


# --------------------------------------------------------------------------------------------
# The start-up a probe needs
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Startup:
    seconds: float
    measured: bool  # True: the fastest passing probe on this machine (cache); False: typical

    def words(self, framework: str) -> str:
        how = ("measured: the fastest probe that passed on this machine" if self.measured
               else f"typical for {framework}: no probe has passed on this machine yet")
        return f"~{self.seconds:.1f} s, {how}"


def startup_floor(framework: str, known: Mapping[str, ProbeResult]) -> Startup:
    """The least time a probe of ``framework`` needs here: the fastest cached probe that passed
    (its elapsed time includes the start-up), else a typical figure."""
    passed = [r.elapsed_s for k, r in known.items()
              if r.status == OK and r.elapsed_s > 0 and k.startswith(f"{framework}:")]
    if passed:
        return Startup(min(passed), measured=True)
    return Startup(TYPICAL_STARTUP_S.get(framework, 3.0), measured=False)


def short_timeout_warning(timeout_s: float, startup: Startup, framework: str) -> str | None:
    """A warning when the timeout is below what a probe needs just to start."""
    if timeout_s >= startup.seconds:
        return None
    return (f"timeout={timeout_s:g} s is shorter than a {framework} probe needs to start here "
            f"({startup.words(framework)}). Probes will run out of time before their collective "
            "runs, and a working backend will look broken: raise timeout= (or "
            "RESILIENT_STRATEGY_TIMEOUT).")


def reclassify_short_timeout(res: ProbeResult, timeout_s: float, startup: Startup,
                             framework: str) -> ProbeResult:
    """A timeout shorter than the start-up is not evidence of a hang: say so in the result.
    A hang judged from the ranks' progress (stuck past start-up) is evidence, and stays."""
    if (res.status != TIMEOUT or res.cause != "timeout" or timeout_s >= startup.seconds
            or judged_hang(res)):
        return res
    return replace(res, cause="timeout_short", detail=(
        f"its {timeout_s:g} s are shorter than a {framework} probe needs to start here "
        f"({startup.words(framework)}); raise timeout="))


# --------------------------------------------------------------------------------------------
# A batch no device takes
# --------------------------------------------------------------------------------------------
#: The largest per-device micro-batch taken for a batch size as meant: above it (a million
#: samples), a DataLoader builds the whole batch in memory at each step, which is rather a
#: dataset's size (or a per-step sample count over many nodes) passed as the global batch.
PLAUSIBLE_DEVICE_BATCH = 2**20


def batch_notice(chosen: Candidate) -> str | None:
    """A word when the chosen candidate's per-device micro-batch is more than
    `PLAUSIBLE_DEVICE_BATCH` samples (``global_batch_size=10**9`` on one CPU: a DataLoader
    would build a billion samples at each step). None otherwise. Pure."""
    per = chosen.per_replica_batch_size
    if per is None or per <= PLAUSIBLE_DEVICE_BATCH:
        return None
    return (f"global_batch_size={chosen.global_batch_size} is {per} samples per device per "
            f"micro-step ({chosen.num_replicas} replica(s), {chosen.accumulation_steps} "
            f"accumulation step(s)), more than the {PLAUSIBLE_DEVICE_BATCH} a device is likely "
            "to hold: a DataLoader builds each batch whole. Is it the dataset's size? Pass the "
            "samples per optimizer step, or max_per_replica_batch= to split it.")


# --------------------------------------------------------------------------------------------
# The fallback warning
# --------------------------------------------------------------------------------------------
def _throughput_words(fraction: float) -> str:
    if fraction >= 0.95:
        return "about the same throughput (estimated)"
    if 0.45 <= fraction <= 0.55:
        return "about half the throughput (estimated)"
    return f"about {max(1, round(fraction * 100))}% of the throughput (estimated)"


def _replicas_words(n: int, framework: str, chosen: Candidate) -> str:
    if chosen.backend == "cpu":
        return "one CPU process"
    if chosen.devices and chosen.backend != "gloo":
        unit = "GPU"
    else:
        unit = "process" if framework == "torch" else "device"
    return f"{n} {unit}{'s' if n > 1 else ''}" if n > 1 else f"one {unit}"


def fallback_warning(
    p: Plan, results: Mapping[str, ProbeResult], facts: Facts, policy: Options, chosen: Candidate,
    *, limit: int = FALLBACK_CHARS,
) -> str | None:
    """One line of at most ``limit`` characters when the choice falls back from what the
    machine should do (a candidate that would have been used failed its probe, or a rule vetoed
    every candidate with as many replicas): what it trains on instead, what failed, why, the
    fix, and the estimated cost, whole parts by importance (`compose`). None when nothing
    better was lost."""
    from ..core.measures.estimate import estimate

    lost = None
    why = cause = said = ""
    for r in p.ruled_out:
        c = r.candidate
        if c.key == chosen.key:
            continue
        res = results.get(c.key)
        if r.rule == "probe" and res is not None and not res.ok:
            extra = dict(res.extra)
            mid_run = extra.get("mid_run")
            cause = res.cause
            what = what_and_fix(res.cause)[0]
            lost, why = c, ("its probe failed" if mid_run is None
                            else f"it failed mid-run at step {mid_run}")
            # no signature placed it: the failing process's own line, quoted, says more than
            # any cause word ("worker_error")
            quote = extra.get("unplaced", "")
            if quote and quote != "(no output)":
                said = f'"{telling_line(quote, QUOTE_CHARS)}"'
                why += f": {said}"
            else:
                why += f": {what}" if what else f" ({res.cause or res.status})"
            break
        if r.rule and r.rule != "probe" and c.num_replicas > chosen.num_replicas and lost is None:
            lost, why = c, f"rule {r.rule} ruled it out"
    if lost is None:
        return None
    then = estimate(chosen, facts, results.get(chosen.key), policy).step_seconds
    best = estimate(lost, facts, None, policy).step_seconds
    fraction = best / then if then > 0 else 1.0
    shape = f"{chosen.num_replicas} x {chosen.accumulation_steps} accumulation, same global batch"
    if lost.num_replicas > chosen.num_replicas:
        cost = (f"{_replicas_words(chosen.num_replicas, chosen.framework, chosen)} instead of "
                f"{lost.num_replicas}, {_throughput_words(fraction)}")
    else:
        cost = _throughput_words(min(1.0, fraction))
    # what trains (the head), why it fell back, the fix, what it costs, the shape: whole
    # parts, the most important first, never a cut one (sel.explain() says all)
    return compose([why, "" if said else what_and_fix(cause)[1], cost, shape], limit,
                   head=f"FALLBACK: {chosen.label} instead of {lost.label}: ",
                   tail=FALLBACK_WHY, keep=2)


# --------------------------------------------------------------------------------------------
# The progress line
# --------------------------------------------------------------------------------------------
class ProgressLine:
    """One line per probe on ``stream``: written when the probe starts, finished when it ends::

        resilient_strategy: probing gloo on 2 CPU processes (timeout 30 s) ... ok in 3.1 s, 1.2 GB/s
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def start(self, c: Candidate, timeout_s: float) -> None:
        self._write(f"resilient_strategy: probing {c.label} (timeout {timeout_s:g} s) ... ")

    def end(self, res: ProbeResult) -> None:
        if res.ok:
            bw = f", {res.bus_bandwidth_gbps:g} GB/s" if res.bus_bandwidth_gbps else ""
            text = f"ok in {res.elapsed_s:.1f} s{bw}"
        elif res.cause == "budget":
            text = "skipped: the probe budget is spent"
        else:
            what = "timed out" if res.status == TIMEOUT else "failed"
            text = f"{what} after {res.elapsed_s:.1f} s ({res.cause})"
        self._write(text + "\n")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr never stops a decision
            pass


def progress_wanted(quiet: bool | None, is_terminal: bool) -> bool:
    """quiet=True: never; quiet=False: always (asked); None: when stderr is a terminal."""
    return not quiet if quiet is not None else is_terminal


def progress_line_for(opts: Options) -> ProgressLine | None:
    """The progress line, on the rank that probes, where wanted (never for a dry run)."""
    import sys

    if opts.dry_run or opts.launch.rank != 0 or opts.probe == "never":
        return None
    stream = sys.stderr
    try:
        terminal = bool(stream.isatty())
    except (AttributeError, ValueError):
        terminal = False
    return ProgressLine(stream) if progress_wanted(opts.quiet, terminal) else None
