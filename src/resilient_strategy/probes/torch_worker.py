"""Probe worker for PyTorch: one rank of a process group that proves a backend works.

    python -m resilient_strategy.probes.torch_worker --rank R --world-size W --backend B \\
        [--devices 0,1] --init-method file:///tmp/x/rdzv --timeout S --message-bytes N \\
        --report PATH [--no-train-step] [--parent-pid PID] [--store HOST:PORT --store-prefix P]

``--store`` joins the group through an existing TCPStore (as a client, under the key prefix
``--store-prefix``) instead of ``--init-method``: the cross-node probe of a multi-node job meets
in the launcher's own store (see :mod:`resilient_strategy.multinode`), opening no port of its own.

Steps: an all-reduce whose result is checked exactly (each rank contributes distinct integers
in float32, so any lost, doubled or corrupted contribution shows); a bus-bandwidth figure from
timed all-reduces of ``--message-bytes``; one DDP step on a small MLP, after which the
parameters must be bit-identical on every rank; the time of a second step. Backends
``single_device`` and ``cpu`` skip the process group and only time the step. The rank writes a
JSON report to ``--report`` in every case it survives, and exits 0 only when it is ``ok``.

Fault injection, to test the runner or rehearse a failure: ``RESILIENT_STRATEGY_PROBE_FAULT`` =
``hang:<rank>`` (that rank sleeps forever before the collective), ``exit:<rank>`` (it exits 1
there, without a report) or ``wrong:<rank>`` (it corrupts one value of its contribution).
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ._common import ProbeFailure, act_on_fault, add_common_arguments, fault_for, run_worker
from ._watchdog import watch_parent

CHECK_NUMEL = 1024  # sums stay far below 2**24, so float32 is exact for any order of addition
WARMUP, ITERS = 2, 10
PROCESS_GROUP_BACKENDS = ("nccl", "gloo")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m resilient_strategy.probes.torch_worker")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--backend", required=True,
                   choices=[*PROCESS_GROUP_BACKENDS, "single_device", "cpu"])
    p.add_argument("--devices", default="", help="CUDA ordinals, one per rank; empty: CPU")
    p.add_argument("--init-method", default="")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--store", default="", help="HOST:PORT of a TCPStore to join as a client")
    p.add_argument("--store-prefix", default="", help="key prefix in --store")
    add_common_arguments(p)
    return p.parse_args(argv)


def probe(args: argparse.Namespace, report: dict[str, Any]) -> None:
    rank, world = args.rank, args.world_size
    fault = fault_for(rank, os.environ, args.backend)
    import torch
    import torch.distributed as dist

    distributed = args.backend in PROCESS_GROUP_BACKENDS
    if args.backend == "nccl" and not dist.is_nccl_available():
        raise ProbeFailure("backend_unavailable",
                           f"torch {torch.__version__} was built without NCCL")
    device = _device(torch, args, rank)
    if device.type == "cpu" and world > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as torchrun does
    if distributed:
        _init(torch, dist, args, device)
    act_on_fault(fault, rank)
    parts = [f"{args.backend} x{world} on {device}"]
    if distributed:
        _check_all_reduce(torch, dist, device, rank, world, corrupt=fault == "wrong")
        parts.append("all-reduce exact")
        if world > 1:
            gbps = _bus_bandwidth(torch, dist, device, world, args.message_bytes)
            report.update(bus_bandwidth_gbps=round(gbps, 3), message_bytes=args.message_bytes)
            parts.append(f"{gbps:.2f} GB/s bus at {args.message_bytes / 2**20:g} MiB")
    if args.train_step:
        seconds = _train_step(torch, dist if distributed else None, device, rank, world)
        report["step_seconds"] = round(seconds, 6)
        parts.append(f"step {seconds * 1e3:.1f} ms")
    if distributed:
        dist.destroy_process_group()
    report["detail"] = "; ".join(parts)


def _device(torch: Any, args: argparse.Namespace, rank: int) -> Any:
    devices = [int(d) for d in args.devices.split(",") if d.strip()]
    if not devices:
        if args.backend == "nccl":
            raise ProbeFailure("no_device", "the nccl backend needs one GPU per rank")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ProbeFailure("no_device", f"torch {torch.__version__} ({build}) sees no GPU")
    index = devices[rank if args.backend in PROCESS_GROUP_BACKENDS else 0]
    if index >= torch.cuda.device_count():
        raise ProbeFailure("no_device",
                           f"GPU {index} asked for, torch sees {torch.cuda.device_count()}")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _init(torch: Any, dist: Any, args: argparse.Namespace, device: Any) -> None:
    kwargs: dict[str, Any] = {
        "backend": args.backend, "rank": args.rank,
        "world_size": args.world_size, "timeout": timedelta(seconds=args.timeout),
    }
    if args.store:
        host, _, port = args.store.rpartition(":")
        client = dist.TCPStore(host.strip("[]"), int(port), is_master=False,
                               timeout=timedelta(seconds=args.timeout), wait_for_workers=False)
        kwargs["store"] = dist.PrefixStore(args.store_prefix, client)
    else:
        kwargs["init_method"] = args.init_method
    if args.backend == "nccl" and "device_id" in inspect.signature(
            dist.init_process_group).parameters:
        kwargs["device_id"] = device  # creates the communicator now: errors surface at init
    dist.init_process_group(**kwargs)


def _sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_all_reduce(
    torch: Any, dist: Any, device: Any, rank: int, world: int, *, corrupt: bool
) -> None:
    base = torch.arange(CHECK_NUMEL, dtype=torch.float32)
    mine = base + 1000.0 * (rank + 1)
    if corrupt:
        mine[CHECK_NUMEL // 2] += 1.0
    x = mine.to(device)
    dist.all_reduce(x)
    got = x.cpu()
    expected = base * world + 1000.0 * world * (world + 1) / 2
    bad = (got != expected).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        raise ProbeFailure(
            "wrong_result",
            f"all-reduce of {CHECK_NUMEL} float32 over {world} ranks: {len(bad)} values wrong, "
            f"first at index {i}: {float(got[i])!r} instead of {float(expected[i])!r}",
        )


def _bus_bandwidth(torch: Any, dist: Any, device: Any, world: int, message_bytes: int) -> float:
    buf = torch.zeros(max(1, message_bytes // 4), dtype=torch.float32, device=device)
    for _ in range(WARMUP):
        dist.all_reduce(buf)
    _sync(torch, device)
    t0 = time.perf_counter()
    for _ in range(ITERS):
        dist.all_reduce(buf)
    _sync(torch, device)
    per_op = (time.perf_counter() - t0) / ITERS
    return float(buf.numel() * 4 / per_op * 2 * (world - 1) / world / 1e9)


def _train_step(torch: Any, dist: Any | None, device: Any, rank: int, world: int) -> float:
    """One warm-up step, then the time of a second; with ``dist``, DDP and a parameter check."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 16)
    ).to(device)
    net = model
    if dist is not None:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank + 1)
    x = torch.randn(32, 64, generator=gen).to(device)
    y = torch.randn(32, 16, generator=gen).to(device)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())  # waits for the device

    step()
    t0 = time.perf_counter()
    loss = step()
    _sync(torch, device)
    seconds = time.perf_counter() - t0
    if not math.isfinite(loss):
        raise ProbeFailure("wrong_result", f"training step gave a non-finite loss {loss}")
    if dist is not None and world > 1:
        sums = torch.stack([p.detach().double().sum() for p in model.parameters()])
        hi, lo = sums.clone(), sums.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        if not torch.equal(hi, lo):
            raise ProbeFailure("wrong_result",
                               "after a DDP step the parameters differ between ranks")
    return seconds


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    watch_parent(args.parent_pid)
    run_worker(args.report, lambda report: probe(args, report))


if __name__ == "__main__":
    main()
