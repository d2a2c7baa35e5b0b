"""A candidate: one way to train (a backend on devices, with its environment and batch split)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ...vocab import MULTI_BACKENDS, MULTI_WORKER_BACKENDS, Backend, backend_named

#: The marks a key's backend segment may carry after the backend's name, in this order.
SHARDED_MARK, OFFLOAD_MARK, NODE0_MARK = "/fsdp", "+offload", "/node0"


@dataclass(frozen=True)
class CandidateKey:
    """A candidate's identity, ``framework:backend[/fsdp][+offload][/node0]:devices[:env]``
    (devices ``0,1`` or ``cpu``; env ``K=V;K=V``), as a value: `parse` reads the text every
    key-keyed table, record and handed decision holds, `format` writes it; the two round-trip
    exactly. The one reader of a key: nothing else splits one by hand."""

    framework: str
    backend: Backend
    devices: tuple[int, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    sharded: bool = False
    offload: bool = False
    node_local: bool = False

    @classmethod
    def parse(cls, text: str) -> CandidateKey:
        """The key ``text`` names; ValueError when it is not one."""
        parts = text.split(":", 3)
        if len(parts) < 3 or not parts[0] or not parts[1]:
            raise ValueError(f"not a candidate key: {text!r}")
        framework, segment, devs = parts[0], parts[1], parts[2]
        node_local = segment.endswith(NODE0_MARK)
        segment = segment.removesuffix(NODE0_MARK) if node_local else segment
        offload = segment.endswith(OFFLOAD_MARK)
        segment = segment.removesuffix(OFFLOAD_MARK) if offload else segment
        sharded = segment.endswith(SHARDED_MARK)
        backend = backend_named(segment.removesuffix(SHARDED_MARK) if sharded else segment)
        if backend is None:
            raise ValueError(f"not a candidate key: {text!r}")
        if devs == "cpu":
            devices: tuple[int, ...] = ()
        else:
            pieces = devs.split(",")
            if not all(p.isdigit() and p.isascii() and str(int(p)) == p for p in pieces):
                raise ValueError(f"not a candidate key: {text!r}")
            devices = tuple(int(p) for p in pieces)
        env: tuple[tuple[str, str], ...] = ()
        if len(parts) == 4:
            pairs = [p.partition("=") for p in parts[3].split(";")]
            if any(not k or not sep for k, sep, _ in pairs):
                raise ValueError(f"not a candidate key: {text!r}")
            env = tuple((k, v) for k, _, v in pairs)
        return cls(framework, backend, devices, env, sharded, offload, node_local)

    @classmethod
    def read(cls, text: str) -> CandidateKey | None:
        """`parse`, or None where ``text`` is not a key (a record of another version)."""
        try:
            return cls.parse(text)
        except ValueError:
            return None

    def format(self) -> str:
        """The key as text (what `parse` reads back)."""
        env = ";".join(f"{k}={v}" for k, v in self.env)
        devs = ",".join(map(str, self.devices)) or "cpu"
        return f"{self.framework}:{self.segment}:{devs}" + (f":{env}" if env else "")

    def __str__(self) -> str:
        return self.format()

    @property
    def segment(self) -> str:
        """The backend with its marks: ``nccl/fsdp+offload``."""
        return (self.backend + (SHARDED_MARK if self.sharded else "")
                + (OFFLOAD_MARK if self.offload else "") + (NODE0_MARK if self.node_local else ""))

    @property
    def last_resort(self) -> bool:
        """One device or the CPU, with no collective to prove (sharded or not)."""
        return self.backend not in MULTI_BACKENDS

    def renumbered(self, devices: tuple[int, ...]) -> CandidateKey | None:
        """This key with its GPUs renumbered to their positions in ``devices``; None when it
        names a GPU outside them. A key on the CPU is kept."""
        if not self.devices:
            return self
        try:
            return replace(self, devices=tuple(devices.index(d) for d in self.devices))
        except ValueError:
            return None

#: Kept for readers of the planner's old name.
MULTI = MULTI_BACKENDS


@dataclass(frozen=True)
class Candidate:
    """One way to train: a backend on devices, with its env and batch split."""

    framework: str
    backend: Backend
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
    def identity(self) -> CandidateKey:
        """This candidate's key as a value."""
        return CandidateKey(self.framework, self.backend, self.devices, self.env, self.sharded,
                            self.offload, self.node_local)

    @property
    def key(self) -> str:
        """This candidate's key as text (`CandidateKey.format`): what tables are keyed by."""
        return self.identity.format()

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
