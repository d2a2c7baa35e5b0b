"""A candidate: one way to train (a backend on devices, with its environment and batch split)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...vocab import MULTI_BACKENDS, MULTI_WORKER_BACKENDS

#: Kept for readers of the planner's old name.
MULTI = MULTI_BACKENDS


@dataclass(frozen=True)
class Candidate:
    """One way to train: a backend on devices, with its env and batch split."""

    framework: str
    backend: str
    devices: tuple[int, ...]
    env: tuple[tuple[str, str], ...] = ()
    num_replicas: int = 1
    accumulation_steps: int = 1
    per_replica_batch_size: int | None = None
    global_batch_size: int | None = None
    origin: str = "chain"  # "chain", a rule id, or "after <cause>"
    first: bool = False  # a remedy to try before plain NCCL
    logical_cpus: bool = False  # TF test mode: the devices are logical CPU devices, not GPUs
    #: The model's state sharded over the replicas (PyTorch FSDP2 ``fully_shard``), not
    #: replicated on each (DDP). Its key says ``<backend>/fsdp``.
    sharded: bool = False
    #: The sharded state lives in host memory (FSDP2 ``CPUOffloadPolicy``): parameters are
    #: copied to the GPU per unit, gradients back, the optimizer steps on the CPU. Its key says
    #: ``<backend>/fsdp+offload``; on one GPU it is FSDP2 over a group of one process.
    offload: bool = False
    #: A multi-node torch job on node 0's own GPUs only (the other nodes' ranks idle), when the
    #: link between the nodes fails: NCCL inside node 0, the global batch kept by accumulation.
    #: Its key says ``<backend>/node0``.
    node_local: bool = False

    @property
    def key(self) -> str:
        env = ";".join(f"{k}={v}" for k, v in self.env)
        devs = ",".join(map(str, self.devices)) or "cpu"
        backend = self.backend + ("/fsdp" if self.sharded else "") + ("+offload" if self.offload
                                                                      else "") \
            + ("/node0" if self.node_local else "")
        return f"{self.framework}:{backend}:{devs}" + (f":{env}" if env else "")

    @property
    def needs_probe(self) -> bool:
        """Multi-replica candidates run a collective, which must be proven before use."""
        return self.backend in MULTI_BACKENDS

    @property
    def label(self) -> str:
        names = {
            "nccl": "NCCL", "hierarchical_copy": "MirroredStrategy + HierarchicalCopyAllReduce",
            "reduction_to_one_device": "MirroredStrategy + ReductionToOneDevice",
            "gloo": "gloo", "single_device": "one GPU", "cpu": "CPU",
            "mw_nccl": "MultiWorkerMirroredStrategy + NCCL",
            "mw_ring": "MultiWorkerMirroredStrategy + RING",
            "mw_auto": "MultiWorkerMirroredStrategy + AUTO",
        }
        text = names[self.backend]
        if self.backend in MULTI_WORKER_BACKENDS:
            local = max(1, len(self.devices))
            where = (f"GPU{'s' if local > 1 else ''} {','.join(map(str, self.devices))}"
                     if self.devices else "CPU")
            return f"{text} across {self.num_replicas // local} workers ({where} each)"
        if self.backend == "single_device" and self.logical_cpus:
            text = "one device"
        if self.backend == "nccl" and self.framework == "tensorflow":
            text = "MirroredStrategy + NCCL"
        if self.sharded and self.backend == "single_device":
            text = "FSDP on one GPU"
        elif self.sharded:
            text = f"FSDP over {text}"
        if self.offload:
            text += " with CPU offload"
        if self.devices and self.backend != "cpu":
            kind = "logical CPU device" if self.logical_cpus else "GPU"
            where = "node 0's " if self.node_local else ""
            text += (f" on {where}{kind}{'s' if len(self.devices) > 1 else ''} "
                     f"{','.join(map(str, self.devices))}")
        elif self.num_replicas > 1:
            text += f" on {self.num_replicas} CPU processes"
        if self.env:
            text += " with " + " ".join(f"{k}={v}" for k, v in self.env)
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key, "label": self.label, "framework": self.framework,
            "backend": self.backend, "devices": list(self.devices), "env": dict(self.env),
            "num_replicas": self.num_replicas, "accumulation_steps": self.accumulation_steps,
            "per_replica_batch_size": self.per_replica_batch_size,
            "global_batch_size": self.global_batch_size, "origin": self.origin,
            "logical_cpus": self.logical_cpus, "sharded": self.sharded, "offload": self.offload,
            "node_local": self.node_local,
        }
