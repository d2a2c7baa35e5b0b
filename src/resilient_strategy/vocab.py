"""The words this library understands, in one place: frameworks, backends, precisions, probe
modes. Constants only (no import of ours), so every module can use them without a cycle."""

from __future__ import annotations

from typing import Literal, get_args

#: Frameworks a decision is made for.
FRAMEWORKS = ("torch", "tensorflow")
#: Other names users give them.
FRAMEWORK_ALIASES = {"tf": "tensorflow", "keras": "tensorflow", "pytorch": "torch"}
#: Every way to train, as a planner backend name: the one vocabulary of backends (a
#: candidate's ``backend``, a probe's, a selection's); the tuples below are its groups.
Backend = Literal["nccl", "hierarchical_copy", "reduction_to_one_device", "gloo", "mw_nccl",
                  "mw_ring", "mw_auto", "single_device", "cpu"]
#: TensorFlow across the workers of a ``TF_CONFIG`` cluster: ``MultiWorkerMirroredStrategy``
#: with ``CommunicationOptions(implementation=NCCL)`` (GPU workers of a CUDA build), ``RING``
#: (TensorFlow's own ring all-reduce over gRPC: CPU and GPU workers) or ``AUTO`` (TensorFlow's
#: runtime picks; see ``core/measures/estimate.TYPICAL_INTER_WORKER_GBPS`` for what it picks).
MULTI_WORKER_BACKENDS: tuple[Backend, ...] = ("mw_nccl", "mw_ring", "mw_auto")
#: PyTorch's process-group backends (one process per replica).
PROCESS_GROUP_BACKENDS: tuple[Backend, ...] = ("nccl", "gloo")
#: TensorFlow's ``MirroredStrategy`` in one process, by its cross-device all-reduce.
MIRRORED_BACKENDS: tuple[Backend, ...] = ("nccl", "hierarchical_copy", "reduction_to_one_device")
#: One replica: one device, or the CPU (nothing to prove).
ONE_REPLICA_BACKENDS: tuple[Backend, ...] = ("single_device", "cpu")
#: Every backend, in the order of `Backend`.
BACKENDS: tuple[Backend, ...] = get_args(Backend)


def backend_named(name: str) -> Backend | None:
    """``name`` as a `Backend`; None when it names none."""
    for backend in BACKENDS:
        if backend == name:
            return backend
    return None


#: Backends that run a collective between replicas (proven by a probe before use).
MULTI_BACKENDS: tuple[Backend, ...] = ("nccl", "hierarchical_copy", "reduction_to_one_device",
                                       "gloo", *MULTI_WORKER_BACKENDS)
#: How the model's state is placed over the devices: "auto" shards (FSDP2) only when a
#: replica does not fit the devices' free memory; "full" always shards; "none" never does.
SHARDING_MODES = ("auto", "full", "none")
#: Whether a sharded model's state may live in host memory (FSDP2's ``CPUOffloadPolicy``):
#: "none" (the default) never; "auto" only where nothing that keeps it on the GPUs fits.
OFFLOAD_MODES = ("none", "auto")
#: Mixed-precision policies.
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
#: How probing is done: probe unless cached, re-probe, or trust the plan.
PROBE_MODES = ("auto", "force", "never")
