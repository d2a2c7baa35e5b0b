"""The cost model: seconds per global batch of a candidate on these facts.

Communication: typical bus bandwidths stand in where nothing was measured; a probe's measured
bandwidth replaces the typical figure. Compute: only ever measured, never derived from the
model's size (a parameter count says nothing of a sample's FLOPs: one token is not a sequence,
one pixel row is not an image): the user's own step measured (`MeasuredStep`, the ranking's
``measured`` input) or the user's ``sample_seconds=``. Without either, the estimate carries an
assumed compute (a ResNet-50-sized sample, `ASSUMED_SAMPLE_FLOPS`) and says it is provisional
(``Estimate.compute == "none"``): the planner then never lets it leave a proven GPU idle
(`core.planning.ranking`). The planner orders candidates by `estimate`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..values.candidate import Candidate
from ..values.facts import Facts
from .probe import ProbeResult

if TYPE_CHECKING:
    from ..call.options import Options

#: Typical all-reduce bus bandwidth (GB/s) when nothing was measured. The NVLink, P2P-off,
#: socket and gloo figures are our measurements on 2x H200 (field-notes); PCIe ones are typical
#: PCIe 4.0 x16 figures; TF's host-staged reductions are estimates and say so.
TYPICAL_BUS_GBPS = {
    "nccl/nvlink": 150.0,
    "nccl/pcie": 12.0,
    "nccl/p2p_off/nvlink": 28.0,
    "nccl/p2p_off/pcie": 10.0,
    "nccl/p2p_off+shm_off": 3.8,
    "gloo": 2.2,
    "hierarchical_copy": 10.0,
    "reduction_to_one_device": 8.0,
    # TensorFlow on logical CPU devices: copies within one process's memory, nothing like the
    # GPU figures above. Measured on the project's 2-core machine (bench_floor / a cold
    # decision's probes, 2026-11-26, TF 2.21): HierarchicalCopy 4.98 GB/s, ReductionToOneDevice
    # 0.84 GB/s (under load both fall to ~0.7-0.95, tests/test_remedies.py). With the GPU figures
    # ReductionToOneDevice's 8 outbid HierarchicalCopy's measured 4.98 and cost every cold
    # decision a second TensorFlow probe (12-19 s there) that measured 0.84.
    "hierarchical_copy/logical_cpu": 5.0,
    "reduction_to_one_device/logical_cpu": 0.85,
}
#: Typical bus bandwidth (GB/s) between nodes when nothing was measured: not measured here (no
#: multi-node hardware was available); a 100 Gb/s InfiniBand/EFA fabric for NCCL, 10 GbE TCP for
#: NCCL over sockets (NCCL_NET=Socket / NCCL_IB_DISABLE=1) and for gloo. A probe across the
#: nodes replaces them with a measurement.
TYPICAL_INTER_NODE_GBPS = {"nccl": 12.0, "nccl/socket": 1.2, "gloo": 1.0}
#: TensorFlow between workers (MultiWorkerMirroredStrategy), not measured between hosts either:
#: NCCL as torch's NCCL between nodes; RING is TensorFlow's ring all-reduce over gRPC, taken as
#: a 10 GbE TCP link like gloo's (two CPU workers on one host measured more over loopback, see
#: the README). Within a worker the local figure applies; the slower of the two counts. AUTO
#: is "automatically chosen by TensorFlow" (tensorflow.org/api_docs/python/tf/distribute/
#: experimental/CommunicationImplementation); TensorFlow's runtime picks NCCL only when the hint
#: is "nccl" or the session config's ``collective_nccl`` is on, else its ring reduce
#: (``AssignCollectiveType`` in tensorflow/core/common_runtime/collective_param_resolver_local.cc;
#: MultiWorkerMirroredStrategy sets ``collective_nccl`` for NCCL only), so AUTO is costed as RING.
TYPICAL_INTER_WORKER_GBPS = {"mw_nccl": 12.0, "mw_ring": 1.0, "mw_auto": 1.0}
#: Effective training FLOP/s of one device by compute-capability major (conservative, fp32/tf32;
#: 3.1e13 was measured for a 100M-parameter MLP on one H200).
DEVICE_FLOPS = {12: 2.5e13, 10: 3.0e13, 9: 3.0e13, 8: 1.5e13, 7: 7e12, 6: 3e12, 0: 3e12}
CPU_FLOPS = 2e11
#: CPU offload (FSDP2 ``CPUOffloadPolicy``), not measured here: each process copies its shard of
#: the parameters host-to-device twice per step (forward, and backward after resharding) and its
#: shard of the gradients device-to-host once (the policy's docstring,
#: https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html), over a PCIe link
#: taken at the 12 GB/s of the ``nccl/pcie`` figure (PCIe 4.0 x16 is 32 GB/s in theory); and
#: the optimizer steps on the CPU, whose cores the node's processes share, taken as AdamW
#: passing over 2 GB of fp32 parameters a second (it reads and writes the parameters, their
#: gradients and two moments: 16 bytes read, 12 written per parameter, memory-bound).
TYPICAL_HOST_LINK_GBPS = 12.0
CPU_OPTIMIZER_BYTES_PER_S = 2e9
ASSUMED_GRADIENT_BYTES = 100 << 20  # ResNet-50: 25.6M fp32 parameters
#: The compute of one sample when nothing measured it: ResNet-50 at 224x224 (~4.1 GFLOPs
#: forward, x3 for training). A placeholder that keeps the estimates' seconds finite (the
#: supervisor's throughput floor compares them); an estimate built on it is provisional and
#: never drops a GPU an NCCL-family probe proved (`core.planning.ranking`). Never derived from
#: the model's size.
ASSUMED_SAMPLE_FLOPS = 1.2e10
ASSUMED_GLOBAL_BATCH = 256
#: Where the compute term of an estimate comes from (``Estimate.compute``): the user's own
#: step measured during training, the user's ``sample_seconds=``, or nothing (assumed,
#: provisional).
COMPUTE_SOURCES = ("measured_step", "sample_seconds", "none")


@dataclass(frozen=True)
class MeasuredStep:
    """The user's own step, measured: the compute seconds of one sample on one device it ran
    on (the seam for the step measurement of issue 41; the planner takes it as its
    ``measured`` input and trusts it over ``sample_seconds=``)."""

    sample_seconds: float

    def __post_init__(self) -> None:
        if not self.sample_seconds > 0:
            raise ValueError(f"a measured step takes a positive time, not {self.sample_seconds!r}")

    @classmethod
    def of(cls, compute_seconds: float, samples: int | None) -> MeasuredStep | None:
        """From a window of training on one replica: its compute seconds (the step's time less
        the communication it waited for) over the ``samples`` that replica computed; None when
        either is unknown or not positive (nothing to rank by)."""
        if samples is None or samples <= 0 or not compute_seconds > 0:
            return None
        return cls(compute_seconds / samples)


def compute_source(policy: Options, measured: MeasuredStep | None = None
                   ) -> tuple[float | None, str]:
    """(compute seconds of one sample on one device, or None; its source, one of
    `COMPUTE_SOURCES`): the measured step first, then ``sample_seconds=``."""
    if measured is not None:
        return measured.sample_seconds, "measured_step"
    if policy.sample_seconds is not None:
        return policy.sample_seconds, "sample_seconds"
    return None, "none"


def offload_seconds(c: Candidate, policy: Options, nodes: int = 1) -> tuple[float, float]:
    """What CPU offload adds per optimizer step of ``c`` (0 when it does not offload): (host
    copies, optimizer step on the CPU), in seconds (see `TYPICAL_HOST_LINK_GBPS`)."""
    if not c.offload:
        return 0.0, 0.0
    grad = policy.gradient_bytes or ASSUMED_GRADIENT_BYTES
    params = policy.param_bytes or grad
    r = max(1, c.num_replicas)
    copies = (2 * params + grad) / r / (TYPICAL_HOST_LINK_GBPS * 1e9)
    local = max(1, r // max(1, nodes))  # the node's processes share its cores
    optimizer = params / r * local / CPU_OPTIMIZER_BYTES_PER_S
    return copies, optimizer


@dataclass(frozen=True)
class Estimate:
    step_seconds: float  # per global batch
    bus_gbps: float | None
    basis: str  # words: where the numbers came from
    #: where its compute term came from (`COMPUTE_SOURCES`); "none": assumed, provisional
    compute: str = "none"

    @property
    def provisional(self) -> bool:
        """Whether no measurement of the user's compute stands behind it."""
        return self.compute == "none"


def _typical_bus(c: Candidate, facts: Facts, policy: Options) -> tuple[float | None, str]:
    if c.num_replicas <= 1:
        return None, ""
    if c.backend in TYPICAL_INTER_WORKER_GBPS:
        between = TYPICAL_INTER_WORKER_GBPS[c.backend]
        if c.backend == "mw_nccl" and len(c.devices) > 1:
            within = "nvlink" if facts.all_nvlink(c.devices) else "pcie"
            return (min(TYPICAL_BUS_GBPS[f"nccl/{within}"], between),
                    f"typical between-worker {c.backend} figure")
        return between, f"typical between-worker {c.backend} figure"
    if c.backend != "nccl":
        key: str = c.backend
        if policy.logical_cpus and f"{key}/logical_cpu" in TYPICAL_BUS_GBPS:
            key = f"{key}/logical_cpu"
    else:
        env = dict(c.env)
        nvlink = facts.all_nvlink(c.devices)
        p2p_off, shm_off = env.get("NCCL_P2P_DISABLE") == "1", env.get("NCCL_SHM_DISABLE") == "1"
        link = "nvlink" if nvlink else "pcie"
        if p2p_off and shm_off:
            key = "nccl/p2p_off+shm_off"
        elif p2p_off:
            key = f"nccl/p2p_off/{link}"
        else:
            key = f"nccl/{link}"
    if policy.nodes > 1 and c.framework == "torch" and not c.node_local:  # between nodes
        env = dict(c.env)
        inter = "nccl/socket" if c.backend == "nccl" and (
            env.get("NCCL_NET") == "Socket" or env.get("NCCL_IB_DISABLE") == "1") else c.backend
        if inter in TYPICAL_INTER_NODE_GBPS:
            return (min(TYPICAL_BUS_GBPS[key], TYPICAL_INTER_NODE_GBPS[inter]),
                    f"typical inter-node {inter} figure")
    return TYPICAL_BUS_GBPS[key], f"typical {key} figure"


def _flops(facts: Facts, c: Candidate) -> float:
    if c.backend == "cpu" or not c.devices:
        return CPU_FLOPS
    devices = set(c.devices)
    majors = [g.compute_capability[0] for g in facts.gpus
              if g.index in devices and g.compute_capability != (0, 0)]  # (0, 0): unread
    if not majors:
        majors = [g.compute_capability[0] for g in facts.gpus if g.compute_capability != (0, 0)]
    major = min(majors) if majors else 8  # nothing known: a middling GPU, the same for all
    return DEVICE_FLOPS.get(major, DEVICE_FLOPS[0] if major < 7 else DEVICE_FLOPS[9])


def estimate(
    c: Candidate, facts: Facts, result: ProbeResult | None, policy: Options,
    measured: MeasuredStep | None = None,
) -> Estimate:
    """Seconds per global batch: compute split over replicas plus the part of one gradient
    all-reduce (sharded: two parameter all-gathers and a gradient reduce-scatter) that backward
    does not hide (DDP overlaps it with backward, about 2/3 of compute;
    Keras fit reduces after backward, so TensorFlow hides none). The compute is ``measured``'s,
    else ``sample_seconds=``'s, else an assumed one (`ASSUMED_SAMPLE_FLOPS`, provisional:
    ``Estimate.compute`` is "none")."""
    grad = policy.gradient_bytes or ASSUMED_GRADIENT_BYTES
    g = policy.global_batch_size or ASSUMED_GLOBAL_BATCH
    seconds, source = compute_source(policy, measured)
    if seconds is not None:
        per_sample = seconds
        how = "measured step" if source == "measured_step" else "compute from sample_seconds="
        if c.backend == "cpu" and facts.gpus:  # measured on a GPU: a CPU is that much slower
            per_sample *= _flops(facts, replace(c, backend="single_device", devices=(0,))) / CPU_FLOPS
    else:
        per_sample = ASSUMED_SAMPLE_FLOPS / _flops(facts, c)
        how = "assumed compute, nothing measured"
    r = c.num_replicas
    compute = g * per_sample / r
    bus: float | None
    if result is not None and result.ok and result.bus_bandwidth_gbps:
        bus, bus_how = result.bus_bandwidth_gbps, "measured bus bandwidth"
    else:
        bus, bus_how = _typical_bus(c, facts, policy)
    # an all-reduce moves 2x the gradients; FSDP2 all-gathers the parameters twice (forward,
    # and again in backward after resharding) and reduce-scatters the gradients once
    volume = 2 * (policy.param_bytes or grad) + grad if c.sharded else grad * 2
    comm = volume * (r - 1) / r / (bus * 1e9) if bus else 0.0
    hidden = compute * 2 / 3 if c.framework == "torch" else 0.0
    basis = how + (f", {bus_how} {bus:g} GB/s" if bus else "")
    copies, optimizer = offload_seconds(c, policy, policy.nodes)
    if c.offload:  # per optimizer step, not hidden behind compute (an estimate that says so)
        basis += (f", CPU offload: host copies at a typical {TYPICAL_HOST_LINK_GBPS:g} GB/s and "
                  "the optimizer step on the CPU")
    step = compute + max(0.0, comm - hidden) + copies + optimizer
    return Estimate(step_seconds=step, bus_gbps=bus, basis=basis, compute=source)


def throughput_fraction(failed_step_s: float, next_step_s: float, failed_replicas: int = 0,
                        next_replicas: int = 0) -> float:
    """The throughput of a step-down relative to what failed: the ratio of the estimated step
    times, and never more than the ratio of the replicas that compute (``next_replicas /
    failed_replicas``, when both are given: GPUs to GPUs). Leaving k GPUs for one is at most
    1/k, whatever the model says of the all-reduce those k GPUs paid for: a communication-bound
    estimate (a large model's gradients over a slow link) must not make one GPU look like half
    of eight to the throughput floor."""
    fraction = failed_step_s / next_step_s if next_step_s > 0 else 1.0
    if failed_replicas > 0 and next_replicas > 0:
        fraction = min(fraction, next_replicas / failed_replicas)
    return fraction
