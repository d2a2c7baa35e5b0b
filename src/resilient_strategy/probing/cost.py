"""What a probe costs, in seconds, by how it ends: the prober's own clock, for planning and for
the testing kit's simulated probes.

Pure: no process, no clock, no environment. A hang is charged what the real prober charges for
it: the start-up of its workers, then the allowance of the same `StallPolicy` that
`stall_policy` hands the runner (`proc`), because that allowance is when the runner
cuts it; a hang the progress records cannot judge (TensorFlow across ``TF_CONFIG`` workers, whose
peers' progress is not seen here) runs to the deadline. A healthy probe is charged its phases at
the typical figures of its class of machine (`TYPICAL`): start-up (a fresh interpreter that
imports the framework, or a worker forked from the deciding process), device and communicator
set-up, the value-checked all-reduces at every checked size, the timed ones for the bandwidth
figure, and the training step. The GPU health check (`health`: after killed GPU probes,
once per decision, deferred) is charged by `health_check_seconds`.

Load is not a fault (issue 41): a probe cut at its deadline or by its stall policy while its
workers waited for a CPU (`CpuShare`: each worker's run-queue wait against the wall time, and
the host's stolen time) was judged on a host too busy to run it: `host_busy` says so, and
`busy_retry_timeout` the deadline its retry gets, scaled to the share of the CPU it got.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..core.measures.probe import ProbeSpec
from ..records.progress import StallPolicy
from ..vocab import PROCESS_GROUP_BACKENDS
from .workers.common import CHECK_ITERS, check_sizes
from .workers.tf_worker import MULTI_WORKER, TRACE_ALLOW_S
from .workers.torch_worker import ITERS, NEW_SIZE_ALLOW_S, WARMUP

#: How a probe ends, as its cost sees it: ``ok`` (healthy, every phase run), a hang the progress
#: records judge (``setup``, ``straggler``, ``collective``, ``quiet``: see
#: `Stall`) or ``deadline`` (a hang nothing judges
#: before the probe's timeout).
HANG_KINDS = ("setup", "straggler", "collective", "quiet")
ENDINGS = ("ok", *HANG_KINDS, "deadline")


#: torch's switch that makes gloo connect its peers at their first collective instead of inside
#: ``init_process_group`` (a string of libtorch since torch 2.7; off by default).
GLOO_LAZY_VAR = "TORCH_GLOO_LAZY_INIT"


def connects_lazily(spec: ProbeSpec, env: Mapping[str, str] | None = None) -> bool:
    """Whether the probe's transport connects its peers inside collective 1 (so collective 1 is
    allowed `StallPolicy.first_collective_extra_s` more). NCCL does (its P2P/SHM/NET
    connections are made at the first collective that needs them, even after an eager
    ``init_process_group(device_id=...)``), and so does TensorFlow's first traced collective;
    gloo connects its full mesh inside ``init_process_group`` (the ``comm_setup`` phase, judged
    by ``setup_grace_s``) unless ``TORCH_GLOO_LAZY_INIT`` is on in the workers' environment
    (the caller's ``env``, passed to them as is)."""
    if spec.framework != "torch" or spec.backend != "gloo":
        return True
    lazy = dict(spec.env).get(GLOO_LAZY_VAR) or (env or {}).get(GLOO_LAZY_VAR, "")
    return lazy.strip().lower() not in ("", "0", "false", "no", "off")


def stall_policy(spec: ProbeSpec, env: Mapping[str, str] | None = None) -> StallPolicy:
    """How a probe's hang is judged from its workers' progress (the spec's timeout stays the
    outer bound). A probe's code never pauses between its records once the communicator is
    ready, so a silent ready rank is stalled too (``quiet_s``). ``env``: the caller's
    environment the workers run with (see `connects_lazily`)."""
    policy = StallPolicy()
    return StallPolicy(
        # communicator set-up grows with the ranks (NCCL: bootstrap ring, topology, channels)
        setup_grace_s=policy.setup_grace_s + 1.0 * ranks_of(spec),
        quiet_s=policy.arrive_grace_s + policy.collective_base_s,
        # a transport that connected in set-up has nothing left to connect in collective 1
        # (issue 21: the gloo rung of the hang ladder was allowed 3 s for a connection it
        # does not make)
        first_collective_extra_s=policy.first_collective_extra_s
        if connects_lazily(spec, env) else 0.0,
    )


def ranks_of(spec: ProbeSpec) -> int:
    """The replicas a probe proves: its processes, or the devices of one TF process."""
    return max(1, spec.world_size, len(spec.devices))


def judged_by_progress(spec: ProbeSpec) -> bool:
    """Whether the runner judges this probe's hangs from progress (else only the deadline)."""
    return spec.workers == 1


@dataclass(frozen=True)
class Figures:
    """Typical seconds of a healthy probe's phases on one class of machine."""

    import_s: float  # start an interpreter and import the framework
    fork_s: float  # a worker forked from the deciding process, the framework imported
    device_s: float  # choose and initialize the device (a CUDA context)
    setup_s: float  # communicator set-up (torch's NCCL connects lazily: inside collective 1)
    bus_bytes_per_s: float  # all-reduce bus bandwidth of a healthy transport
    latency_s: float  # each collective call, synchronized
    step_s: float  # the training step: a model built, two steps (torch), Keras' train step traced
    #: TensorFlow across TF_CONFIG workers proves the step through ``model.fit`` (its
    #: distributed input pipeline built three times, the first batch reduced): this much more
    fit_s: float = 0.0


#: Sources: torch import 2.6 s and a forked worker's start measured on a 16-core host (issue 21);
#: the field run on 2x H100 (benchmarks/results/h100x2-2026-11-25.md): a hung NCCL probe cut
#: 9.1 s after its workers were forked with collective 1 allowed 8.0 s (so 1.1 s from fork to
#: every rank inside it), a healthy cold probe 7.2 s, and 22.5 s for a decision of two probes
#: (9.1 + 8.2 s) of which ~4 s went to the health check after the hang; gloo on the loaded
#: 2-core CI machine 0.4 GB/s (records/progress.py); TensorFlow's start-up 5 s
#: (deciding/notices.py TYPICAL_STARTUP_S) and its traced first collective. The torch step
#: since the probe's step lost DDP and torch.optim (no torch._dynamo import, 2026-11-26): ~0.25 s
#: on an H100 (checked -> finished in benchmarks/results/floor-h100x1-2026-11-26.md), ~0.06 s on
#: CPU. The health check (`health_check_seconds`) is a start-up plus ``device_s`` per GPU:
#: the field run's ~4 s after the hang = a fresh ``import torch`` (2.6 s) + 2 GPUs initialised.
#: TensorFlow's step on one worker is two ``train_on_batch`` calls since 2026-11-26: 0.5-1.2 s
#: on 2 logical CPUs of the loaded 2-core machine (the probe's "measured" -> "stepped" phases,
#: benchmarks/results/floor-cpu2-2026-11-26-tf.md), against 1.4-1.6 s for the two-batch ``fit``
#: still used across workers (+0.7 s). On GPUs (no TensorFlow on the lent GPU machines) the old
#: fit figure of 4 s is split in the same proportion.
TYPICAL: dict[tuple[str, bool], Figures] = {
    # (framework, on GPUs)
    ("torch", True): Figures(import_s=2.6, fork_s=0.3, device_s=0.6, setup_s=0.2,
                             bus_bytes_per_s=50e9, latency_s=0.001, step_s=0.25),
    ("torch", False): Figures(import_s=2.6, fork_s=0.3, device_s=0.0, setup_s=0.3,
                              bus_bytes_per_s=0.4e9, latency_s=0.002, step_s=0.06),
    ("tensorflow", True): Figures(import_s=5.0, fork_s=5.0, device_s=0.6, setup_s=1.0,
                                  bus_bytes_per_s=20e9, latency_s=0.002, step_s=2.0, fit_s=2.0),
    ("tensorflow", False): Figures(import_s=5.0, fork_s=5.0, device_s=0.0, setup_s=0.5,
                                   bus_bytes_per_s=0.4e9, latency_s=0.005, step_s=1.0, fit_s=0.7),
}


def on_gpus(spec: ProbeSpec) -> bool:
    return bool(spec.devices) and not spec.logical_cpus and spec.backend != "cpu"


def figures_for(spec: ProbeSpec) -> Figures:
    return TYPICAL[("tensorflow" if spec.framework == "tensorflow" else "torch", on_gpus(spec))]


def _collective_s(f: Figures, nbytes: int, ranks: int) -> float:
    return f.latency_s + nbytes * 2 * (ranks - 1) / ranks / f.bus_bytes_per_s


def first_collective(spec: ProbeSpec) -> tuple[int, float]:
    """Bytes and declared allowance of a probe's collective 1, as its worker records them."""
    nbytes = min(check_sizes(",".join(map(str, spec.check_bytes))))
    return nbytes, TRACE_ALLOW_S if spec.framework == "tensorflow" else NEW_SIZE_ALLOW_S


def probe_seconds(spec: ProbeSpec, ending: str, *, forked: bool = False,
                  warm: bool = False, figures: Figures | None = None,
                  env: Mapping[str, str] | None = None) -> float:
    """Seconds a probe of ``spec`` runs until it ends as ``ending`` (one of `ENDINGS`),
    at most its timeout. ``forked``: its workers are forked from the deciding process (torch),
    which ``warm`` says had already imported the framework for an earlier probe. ``env``: the
    caller's environment (as `stall_policy` takes it)."""
    if ending not in ENDINGS:
        raise ValueError(f"probe ending {ending!r}: one of {list(ENDINGS)}")
    f = figures or figures_for(spec)
    if ending == "deadline" or (ending != "ok" and not judged_by_progress(spec)):
        return spec.timeout_s
    policy = stall_policy(spec, env)
    start = (f.fork_s + (0.0 if warm else f.import_s) if forked else f.import_s) + f.device_s
    ranks = ranks_of(spec)
    group = spec.framework == "tensorflow" or spec.backend in PROCESS_GROUP_BACKENDS
    ready = start + (f.setup_s if group else 0.0)
    if ending == "setup":
        cost = start + policy.setup_grace_s
    elif ending == "straggler":
        cost = start + policy.arrive_grace_s
    elif ending == "collective":
        nbytes, allow = first_collective(spec)
        cost = ready + policy.collective_grace(1, nbytes, allow)
    elif ending == "quiet":
        cost = ready + (policy.quiet_s or 0.0)
    else:
        cost = ready + f.step_s + (f.fit_s if spec.backend in MULTI_WORKER else 0.0)
        if group:
            sizes = check_sizes(",".join(map(str, spec.check_bytes)))
            cost += sum(CHECK_ITERS * _collective_s(f, n, ranks) for n in sizes)
            if ranks > 1:
                cost += (WARMUP + ITERS) * _collective_s(f, spec.message_bytes, ranks)
    return round(min(cost, spec.timeout_s), 3)


def health_check_seconds(framework: str, gpus: int, *, forked: bool = False,
                         warm: bool = False, figures: Figures | None = None) -> float:
    """Seconds one GPU health check of ``gpus`` GPUs takes (`health.run_check`): its
    process starts (forked from the deciding process for torch when ``forked`` and ``warm``,
    else a fresh interpreter importing the framework), then initialises each GPU in turn and
    runs a checked kernel on it (``device_s`` each). Nothing for no GPU."""
    if gpus <= 0:
        return 0.0
    f = figures or TYPICAL[("tensorflow" if framework == "tensorflow" else "torch", True)]
    start = f.fork_s + (0.0 if warm else f.import_s) if forked else f.import_s
    return round(start + gpus * f.device_s, 3)


# ----- load is not a fault ----------------------------------------------------------------------
#: A worker that spent this share of the probe's wall time runnable but waiting for a CPU ran on
#: a saturated host (a loaded 2-core machine at load ~16 waits ~85 % of the time).
BUSY_WAIT_SHARE = 0.25
#: The share of the host's CPU time a hypervisor took meanwhile (a VM's steal) that is as busy.
BUSY_STEAL_SHARE = 0.25
#: The most a busy probe's deadline is stretched (a probe that got under 1/8 of a CPU is retried
#: with 8x its deadline, not more: a deadline that never comes is no deadline).
MAX_BUSY_SCALE = 8.0


@dataclass(frozen=True)
class CpuShare:
    """What a probe's workers got of the host while it ran, read when the runner cut it:
    ``wall_s`` since the workers started; for each worker still running then, its seconds on a
    CPU and its seconds runnable but waiting for one (``schedstat``); ``steal`` the share of the
    host's CPU time a hypervisor took meanwhile (0 on bare metal)."""

    wall_s: float
    on_cpu_s: tuple[float, ...]
    waited_s: tuple[float, ...]
    steal: float = 0.0


def got_share(share: CpuShare) -> float:
    """The share of the CPU time it wanted that the most starved worker got (1.0: all of it):
    its on-CPU seconds over its on-CPU and waiting seconds, less the host's stolen share."""
    worst = 1.0
    for on_cpu, waited in zip(share.on_cpu_s, share.waited_s, strict=False):
        if on_cpu + waited > 0:
            worst = min(worst, on_cpu / (on_cpu + waited))
    return max(0.0, worst * (1.0 - min(1.0, max(0.0, share.steal))))


def host_busy(share: CpuShare | None) -> bool:
    """Whether the probe ran on a host too busy to judge it by its deadline: a worker waited for
    a CPU `BUSY_WAIT_SHARE` of the wall time or more, or a hypervisor stole
    `BUSY_STEAL_SHARE` of the host's CPU time. A hung worker blocked in a collective waits on
    its peer, not on a run queue: it is not busy. Pure."""
    if share is None or share.wall_s <= 0:
        return False
    waited = max(share.waited_s, default=0.0)
    return waited / share.wall_s >= BUSY_WAIT_SHARE or share.steal >= BUSY_STEAL_SHARE


def busy_retry_timeout(timeout_s: float, share: CpuShare, cap_s: float) -> float:
    """The deadline of a busy probe's retry: ``timeout_s`` scaled by how little of the CPU its
    workers got (`got_share`: a quarter of it, four times the deadline), at most
    `MAX_BUSY_SCALE` times and at most ``cap_s``; never less than ``timeout_s``. Pure."""
    scale = min(MAX_BUSY_SCALE, 1.0 / max(got_share(share), 1.0 / MAX_BUSY_SCALE))
    return round(max(timeout_s, min(cap_s, timeout_s * scale)), 3)
