"""TensorFlow multi-worker jobs (``TF_CONFIG``): the workers decide together, with no store.

Under a ``TF_CONFIG`` of 2 or more chief/worker tasks (`tfcluster`), every worker calls
``resilient_strategy()`` itself. TensorFlow offers nothing like torch's TCPStore to agree through
before a strategy exists, so the agreement is the probes themselves:

- every worker plans from its own facts with the same options, so it plans the same candidates
  in the same order (``MultiWorkerMirroredStrategy`` with NCCL, then RING, then AUTO, then
  worker 0 alone: under MirroredStrategy over its own GPUs, then on one device);
- a candidate across the workers is proven by one process on *each* worker (the probe worker
  ``probing/workers/tf_worker.py`` with the user's ``TF_CONFIG``: the same addresses the training will
  bind, free again once the probe process has exited or been killed at its deadline);
- its first all-reduce carries the candidate's key (a CRC), so workers probing different
  candidates fail on a value mismatch, never pass; its last all-reduce is a *verdict*: each
  worker's pass/fail and its measured figures (bandwidth, step time, a checksum of the trained
  weights), summed, so that every worker reports the same verdict and the same numbers, and so
  plans on to the same choice;
- a probe that fails on one worker fails on the others too: the peer waits in a collective
  that never completes, until its own deadline (the probe's ``timeout``).

No cache is read or written (a worker's cache cannot speak for the links), as between torch
nodes (`multinode`). When no candidate across the workers is proven, or the estimate says
worker 0 alone is faster, worker 0 trains alone keeping the global batch and the other workers
exit 0 at ``scope()`` (``Selection.active`` is False there), saying why. Worker 0 alone first
tries MirroredStrategy over its own GPUs (2 or more), which it alone probes: the planner places
it after every candidate across the workers that is tried (``plan._multi_worker_order``), so a
worker other than 0 that reaches it knows worker 0 trains alone whatever that probe says, and
exits without probing it (``Chosen.how == "worker_0_alone"``).

Rounds: after a failed round, a worker waits until every worker's process of that round is
surely gone before starting the next (`SettlingProber`): the round's start + its timeout +
the runner's kill grace (`KILL_GRACE_S`: TensorFlow catches SIGTERM, so the second signal,
SIGKILL, is what ends it) + `SETTLE_S`, the start skew between workers it allows.

Residual risks, honestly:

- the workers must start ``resilient_strategy()`` within about the probe timeout of each other
  (as they must to train under MultiWorkerMirroredStrategy at all); a worker that starts a round
  later than `SETTLE_S` after the others may find a peer's previous-round process still
  bound to its port, and that round fails on every worker (a false failure, never a false pass:
  the key in the first all-reduce sees to that);
- a worker killed at its deadline in the milliseconds between the verdict all-reduce completing
  and its report being written would count the round failed while its peers count it passed.
  Each worker votes "fail" when less than `VERDICT_MARGIN_S` of its probe's time is left,
  which keeps the verdict well inside every deadline, but the window is not zero. If it happens,
  worker 0 trains under MultiWorkerMirroredStrategy alone and its first collective fails after
  ``process_group_timeout`` (no silent wrong training).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..core.measures.probe import ProbeResult, ProbeSpec
from ..core.trace.choosing import MultiWorkerDecided, WorkerProbe
from ..probing.base import ProbeFn, Prober
from ..vocab import MULTI_WORKER_BACKENDS

if TYPE_CHECKING:
    from ..core.call.options import Options
    from ..core.planning.plan import Plan
    from ..core.values.candidate import Candidate
    from ..core.values.facts import Facts

log = logging.getLogger("resilient_strategy")
__all__ = ["KILL_GRACE_S", "SETTLE_S", "SettlingProber", "decide_across_workers"]

#: The start skew between workers a round allows (and time for the ports to be free again).
SETTLE_S = 5.0
#: The runner's stop of a probe process at its deadline: SIGTERM, 2 s, SIGKILL, 2 s (`probing.proc`).
KILL_GRACE_S = 4.0
#: A worker with less than this left of its probe's time votes "fail" in the verdict
#: (the probe worker's own constant, repeated here for the docs: probing/workers/tf_worker.py).
VERDICT_MARGIN_S = 3.0


class SettlingProber(Prober):
    """Runs the probes of a multi-worker decision; before a round across the workers that
    follows a failed one, waits until every worker's process of that round is gone."""

    def __init__(self, prober: ProbeFn, clock: Callable[[], float],
                 sleep: Callable[[float], None]) -> None:
        self._prober = prober
        self._clock = clock
        self._sleep = sleep
        self._not_before = [float("-inf")]  # when the next round across the workers may start

    def probe(self, spec: ProbeSpec, env: Mapping[str, str]) -> ProbeResult:
        if spec.workers <= 1:
            return self._prober(spec, env)
        wait = self._not_before[0] - self._clock()
        if wait > 0:
            log.info("resilient_strategy: waiting %.1f s for every worker's process of the last "
                     "failed probe round to be gone", wait)
            self._sleep(wait)
        start = self._clock()
        result = across_workers(self._prober(spec, env), spec)
        if not result.ok:
            self._not_before[0] = start + spec.timeout_s + KILL_GRACE_S + SETTLE_S
        return result


def across_workers(result: ProbeResult, spec: ProbeSpec) -> ProbeResult:
    """``result`` of this worker's process, marked as a probe across ``spec.workers`` workers."""
    extra = (*result.extra, ("workers", str(spec.workers)),
             ("worker_rank", str(spec.worker_rank)))
    detail = result.detail
    if not detail.startswith("across "):
        detail = f"across {spec.workers} workers (this is worker {spec.worker_rank}): {detail}"
    return replace(result, extra=extra, detail=detail)


def decide_across_workers(
    facts: Facts, opts: Options, env: Mapping[str, str], prober: Prober,
    clock: Callable[[], float], decide: Callable[..., Any],
) -> tuple[Plan, dict[str, ProbeResult], bool]:
    """This worker's part of the decision of a TF_CONFIG job (see the module's docstring):
    the plan with a `MultiWorkerDecided` event, the results, and whether the
    choice was proven. ``decide``: the executor's (this module imports no executor)."""
    if not prober.simulated:  # a simulation has no processes to wait for
        prober = SettlingProber(prober, clock, time.sleep)
    d = decide(facts, opts, env, prober, clock)
    p: Plan = d.plan
    known: dict[str, Candidate] = {c.key: c for c in p.candidates}
    known.update({r.candidate.key: r.candidate for r in p.ruled_out})
    probed = tuple(
        WorkerProbe(known[k], r.status, r.cause, "" if r.ok else r.why())
        for k, r in d.results.items()
        if k in known and known[k].backend in MULTI_WORKER_BACKENDS
    )
    chosen = p.chosen
    alone = chosen is not None and chosen.backend not in MULTI_WORKER_BACKENDS
    active = not alone or opts.tf_worker_rank == 0
    event = MultiWorkerDecided(opts.tf_workers, opts.tf_worker_rank, opts.tf_task, probed,
                               chosen, alone, active, bool(d.proven))
    if not active and chosen is not None:
        log.warning("resilient_strategy: worker %d of %d: no strategy across the TF_CONFIG "
                    "workers beats worker 0 alone, so worker 0 trains alone (%s); this worker "
                    "exits 0 at scope().", opts.tf_worker_rank, opts.tf_workers, chosen.label)
    return replace(p, events=(*p.events, event)), dict(d.results), bool(d.proven)
