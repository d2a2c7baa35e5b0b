"""The chain of candidates: the devices that can be used, every way to train the framework on
them (one node, several nodes, TensorFlow workers), sharded and stepped down until they fit
memory (the steps are `sharding`'s)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import InvalidOptionError
from ...vocab import MIRRORED_BACKENDS, PROCESS_GROUP_BACKENDS
from ..values.candidate import Candidate
from ..values.facts import Facts
from .shapes import Build
from .sharding import check_memory, shard_chain

if TYPE_CHECKING:
    from ..call.options import Options


def usable_gpus(facts: Facts, policy: Options, b: Build) -> tuple[int, ...]:
    visible = tuple(g.index for g in facts.gpus)
    if facts.nvml_error and not visible:
        b.note("no_gpu_facts", f"No GPU facts: {facts.nvml_error}.")
    for note in facts.visibility.notes:
        b.note("visible_devices", f"CUDA_VISIBLE_DEVICES: {note}")
    if facts.nvml_notes:
        b.note("nvml_unread", "NVML could not read some facts, which count as unknown (no rule "
               "fires on them): " + "; ".join(facts.nvml_notes) + ".")
    if policy.devices is None:
        return visible
    missing = [d for d in policy.devices if d not in visible]
    if missing:
        raise InvalidOptionError(
            f"devices={list(policy.devices)} names GPU(s) {missing} that this job cannot see "
            f"(visible: {list(visible)}; indices are after CUDA_VISIBLE_DEVICES)"
        )
    b.note("devices_asked", f"Using GPUs {list(policy.devices)} as asked (devices=).")
    return tuple(policy.devices)


def build_chain(
    fw: str, gpus: tuple[int, ...], has_cuda: bool, policy: Options, b: Build,
    build: str = "", mig: bool = False,
) -> tuple[list[Candidate], int]:
    """The static chain for this framework, before rules and results, and the number of
    devices the best plan would use (the one-device fallbacks accumulate that many steps).
    ``mig``: the GPUs are MIG instances (a launch of more processes than the one instance each
    sees falls back to one slice on rank 0, said as ``mig_one_slice``)."""
    out: list[Candidate] = []
    n_proc = policy.world_size if fw == "torch" else 1
    nodes = policy.nodes if fw == "torch" else 1
    local = n_proc // nodes  # processes (and GPUs used) per node
    if gpus and not has_cuda:
        if build == "rocm":  # not CPU-only: it runs AMD GPUs, and these are NVIDIA's
            b.note("rocm_build", f"{fw} is a ROCm build (AMD GPUs through HIP): it cannot use "
                   "these NVIDIA GPUs; install a CUDA build to use them.")
        else:
            b.note("cpu_only_build",
                   f"{fw} is a CPU-only build: the GPUs are unusable from it; install a CUDA "
                   "build to use them.")
        gpus = ()
    if policy.multi_worker:
        return multi_worker_chain(fw, gpus, has_cuda, policy, b)
    if fw == "tensorflow" and policy.tf_task.startswith("evaluator"):
        b.note("tf_evaluator", f"TF_CONFIG names this task {policy.tf_task}: an evaluator sits "
               "outside the workers' collectives (as in MultiWorkerMirroredStrategy), so it plans "
               "its own devices alone.")
    if fw == "torch" and n_proc > 1:
        multi_devs = gpus[:local] if len(gpus) >= local else ()
        if gpus and len(gpus) < local and mig:
            b.note("mig_one_slice", f"The launcher started {local} processes on this node and "
                   f"they see {len(gpus)} MIG instance(s): CUDA shows each process one MIG "
                   "instance and NCCL runs no process group across MIG instances, so rank 0 "
                   f"trains on one slice with {local} accumulation steps (the global batch "
                   "kept) and the other ranks exit 0.")
        elif gpus and len(gpus) < local:
            b.note("too_few_gpus", f"The launcher started {local} processes on this node but "
                   f"only {len(gpus)} GPUs are visible.")
        if nodes > 1:
            b.note(
                "multi_node",
                f"Multi-node job: {nodes} nodes x {local} processes; a backend between nodes "
                "runs at the network's speed (no cache: a node's cache cannot speak for the "
                "links).",
            )
    else:
        multi_devs = gpus
    multi_ok = len(multi_devs) >= 2 or (fw == "torch" and n_proc > 1)
    reference = len(multi_devs) if multi_ok and multi_devs else max(1, n_proc)
    if fw == "torch" and n_proc == 1 and len(gpus) >= 2:
        advice = (
            f"This is one process, and PyTorch runs one process per GPU: it trains on one GPU "
            f"with {len(gpus)} accumulation steps here. To use all {len(gpus)} GPUs, start it "
            f"with `torchrun --nproc_per_node {len(gpus)} <your script>`."
        )
        b.note("one_process", advice)
        b.warnings.append(advice)
        multi_ok = False
    logical = bool(policy.logical_cpus)  # the "GPUs" are logical CPU devices (a test mode)
    if multi_ok and multi_devs:
        backends = PROCESS_GROUP_BACKENDS if fw == "torch" else MIRRORED_BACKENDS
        if fw == "tensorflow" and logical:
            b.note("no_nccl_on_cpu", "NCCL is not tried on logical CPU devices: TensorFlow's "
                   "NcclAllReduce has no CPU kernel (it builds, then fails at the first step).")
            backends = backends[1:]
        replicas = len(multi_devs) * nodes
        for backend in backends:
            out.append(Candidate(fw, backend, multi_devs, num_replicas=replicas,
                                 logical_cpus=logical))
        if fw == "torch" and nodes > 1 and len(multi_devs) >= 2:
            # where the nodes cannot talk: node 0's own GPUs over NCCL (as TensorFlow keeps
            # worker 0's MirroredStrategy), not one GPU of the whole job
            out.append(Candidate(fw, "nccl", multi_devs, num_replicas=len(multi_devs),
                                 node_local=True))
    elif multi_ok:  # torch under a launcher on CPU: gloo between the processes
        out.append(Candidate(fw, "gloo", (), num_replicas=n_proc))
    if gpus:
        out.append(Candidate(fw, "single_device", gpus[:1], logical_cpus=logical))
    out.append(Candidate(fw, "cpu", ()))
    return out, reference


def multi_worker_chain(
    fw: str, gpus: tuple[int, ...], has_cuda: bool, policy: Options, b: Build
) -> tuple[list[Candidate], int]:
    """TensorFlow across the workers of a TF_CONFIG cluster: MultiWorkerMirroredStrategy with
    NCCL (GPU workers of a CUDA build), then with RING (TensorFlow's ring all-reduce over gRPC,
    CPU or GPU), then with AUTO (TensorFlow's pick, after RING: `ranking._multi_worker_order`),
    each with every worker's local devices as replicas. Then worker 0 alone (the other workers
    exit): with 2+ local GPUs, MirroredStrategy over all of them (the local chain: NCCL,
    HierarchicalCopy, ReductionToOneDevice; the global batch kept by a larger per-replica batch,
    as Keras cannot accumulate under it), then on one device accumulating as many steps as the
    job has replicas. `ranking._multi_worker_order` places worker 0's MirroredStrategy between.
    """
    workers = policy.tf_workers
    local = gpus if has_cuda else ()
    replicas = workers * max(1, len(local))
    b.note("multi_worker", (
        f"Multi-worker job (TF_CONFIG): this task is {policy.tf_task or 'a worker'}, worker "
        f"{policy.tf_worker_rank} of {workers}; MultiWorkerMirroredStrategy runs at the "
        "network's speed between workers, and every worker proves it together with the others "
        "(no cache: a worker's cache cannot speak for the links). When no backend across the "
        "workers beats worker 0 alone, worker 0 trains alone and the others exit 0: "
        + (f"on its {len(local)} GPUs under MirroredStrategy if that passes its probe, else "
           if len(local) >= 2 else "")
        + f"on one device with {replicas} accumulation steps."))
    out: list[Candidate] = []
    if local:
        out.append(Candidate(fw, "mw_nccl", local, num_replicas=replicas))
    out.append(Candidate(fw, "mw_ring", local, num_replicas=replicas))
    out.append(Candidate(fw, "mw_auto", local, num_replicas=replicas))
    if len(local) >= 2:  # worker 0 alone on all of its GPUs
        out += [Candidate(fw, backend, local, num_replicas=len(local))
                for backend in MIRRORED_BACKENDS]
    if gpus:
        out.append(Candidate(fw, "single_device", gpus[:1]))
    out.append(Candidate(fw, "cpu", ()))
    return out, replicas


def shard(cands: list[Candidate], facts: Facts, policy: Options, b: Build) -> list[Candidate]:
    """Shard the multi-process candidates (FSDP2) where ``sharding=`` says (sharding.py)."""
    out, event = shard_chain(cands, facts, policy)
    if event is not None:
        b.events.append(event)
    return out


def fitting(cands: list[Candidate], facts: Facts, policy: Options, b: Build) -> list[Candidate]:
    """Rule out the candidates whose model state does not fit their devices (sharding.py)."""
    too_big, event = check_memory(cands, facts, policy)
    if event is None:
        return cands
    b.events.append(event)
    for row in too_big:
        b.rule_out(row.candidate, "memory", row.text(), rule="memory", said=True)
    out = {row.candidate.key for row in too_big}
    return [c for c in cands if c.key not in out]
