"""Probe worker for PyTorch: one rank of a process group that proves a backend works.

    python -m resilient_strategy.probing.workers.torch_worker --rank R --world-size W --backend B \\
        [--devices 0,1] --rendezvous DIR --timeout S --message-bytes N \\
        --report PATH [--no-train-step] [--parent-pid PID] [--store HOST:PORT --store-prefix P]

The ranks meet the way a training process group does under torchrun or ``resilient-strategy
run``: through torch's TCPStore, with the transport the installed torch uses by default (its
libuv server since torch 2.4, ``USE_LIBUV=0`` the older one: `store_uses_libuv` follows torch's
own rule). With ``--rendezvous DIR`` (the probe's private run directory) rank 0 hosts the store
on a port the kernel picks (port 0: nothing to collide with) and publishes it in ``DIR``; the
other ranks read it there and join as clients, every wait under ``--timeout``. The group's keys
live under ``default_pg`` as ``init_process_group`` puts them. ``--store`` joins the group
through an existing TCPStore instead (as a client, under the key prefix ``--store-prefix``): the
cross-node probe of a multi-node job meets in the launcher's own store (see
`resilient_strategy.nodes.manynodes`), opening no port of its own. (The file store of earlier
versions is gone: no training group meets through one, so a probe through it proved a path
training never takes, and missed the one it does.)

Steps, each reported to the runner through ``--progress`` (see
`resilient_strategy.records.progress`): started, torch imported, device ready, communicator setup
and ready, then every collective by number. All-reduces checked exactly at the sizes DDP sends
(4 KiB, 256 KiB: below the 512 KiB where some NCCL builds first fail, 1 MiB, DDP's 25 MiB
bucket, ``--check-bytes`` such as the user's largest bucket), several iterations each, with
contributions that change every iteration (a stale buffer shows); each rank contributes a
distinct multiple of one integer pattern, so every sum is exact in float32 and any lost,
doubled, misplaced or corrupted contribution shows. A NaN, a zero or any other wrong value is a
failure with its own cause. The ``--message-bytes`` all-reduces are checked too and timed for a
bus-bandwidth figure. Every process-group candidate then proves the other collectives a training
job issues, at the same sizes and as exactly (`_common.OTHER_ITERS` iterations each, with
values that change between them): broadcast (DDP's parameter sync at start, a checkpoint or a
metric sent from one rank; each iteration from another root) and all-gather (metrics,
checkpoint metadata, FSDP2's parameters; each rank's chunk must land in place). Then one
data-parallel step on a small MLP with DDP's collectives written out (the parameters broadcast from rank 0, the gradients all-reduced as one bucket and averaged,
an SGD update by hand: constructing ``DistributedDataParallel`` or a ``torch.optim`` optimizer
imports ``torch._dynamo`` and sympy, 2 s on this project's 2-core machine and up to 8 s when it
is loaded, which the training pays anyway and the proof does not need), after which the parameters must be bit-identical on every rank, and the time of a
second step. With ``--sharded`` (an FSDP2
candidate) the probe also proves reduce-scatter (FSDP2's gradients), at the same sizes, each
sum checked exactly, and its training step shards the MLP with ``fully_shard`` instead of
DDP (the full parameters, gathered, must then match on every rank). Backends ``single_device`` and
``cpu`` skip the process group and only time the step. The rank writes a JSON report to
``--report`` in every case it survives, and exits 0 only when it is ``ok``.

On the nccl backend, before the communicator exists, the worker reads the version of the NCCL
torch loaded (``torch.cuda.nccl.version()``) and sets what `resilient_strategy.core.knowledge.nccldiag`
says for it, never a variable its environment already has: every connection formed at init
(``NCCL_RUNTIME_CONNECT=0``, NCCL >= 2.22: by default connections form at the first collective
that needs them, so a probe could leave untried the ones training uses) and NCCL's own
diagnostics (NCCL >= 2.31), whose report NCCL prints on rank 0's stdout; the report records
what was set and kept (``nccl_diagnostics``), and the parser reads the report from the output.

Fault injection, to test the runner or rehearse a failure: ``RESILIENT_STRATEGY_PROBE_FAULT`` =
``<fault>:<rank>[:<backend>]`` with a fault of `_common.FAULTS`: ``hang`` (sleeps before
the first collective), ``hang_setup`` (inside communicator setup), ``hang_rendezvous`` (inside
the store rendezvous: rank 0 never publishes its store, another rank never joins),
``hang_collective`` (inside collective 1), ``hang_broadcast`` / ``hang_gather`` (inside the
first broadcast / all-gather), ``exit`` (exits 1 there, without a report), ``wrong`` / ``nan``
/ ``zero`` (corrupts its all-reduce contribution or result), ``wrong_broadcast`` /
``wrong_gather`` (a wrong value in what its broadcast / all-gather returned); a fourth field narrows it: ``plain`` (only a
worker without a remedy's variables) or ``>=N`` (data faults only in all-reduces of N bytes or
more): see `_common.fault_for`.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import os
import socket
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from ...core.knowledge.nccldiag import diagnostic_env
from ...machine.files import read_json, write_json_atomic
from ...records.progress import (
    COMM_READY,
    COMM_SETUP,
    DEVICE_READY,
    FINISHED,
    IMPORTED,
    ProgressWriter,
)
from ...vocab import ONE_REPLICA_BACKENDS, PROCESS_GROUP_BACKENDS
from .common import (
    CHECK_ITERS,
    OTHER_ITERS,
    PATTERN_MOD,
    STEP_ALLOW_S,
    ProbeFailure,
    act_on_fault,
    add_common_arguments,
    check_sizes,
    contribution,
    corrupts,
    expected_sum,
    fault_for,
    human,
    mismatch_failure,
    record_bandwidth,
    run_worker,
    spread,
)
from .watchdog import watch_parent

WARMUP, ITERS = 2, 10
NEW_SIZE_ALLOW_S = 3.0  # the first all-reduce at each size, on top of the transfer


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m resilient_strategy.probing.workers.torch_worker")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--backend", required=True,
                   choices=[*PROCESS_GROUP_BACKENDS, *ONE_REPLICA_BACKENDS])
    p.add_argument("--devices", default="", help="CUDA ordinals, one per rank; empty: CPU")
    p.add_argument("--rendezvous", default="",
                   help="the probe's private directory: rank 0 publishes its store's port there")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--store", default="", help="HOST:PORT of a TCPStore to join as a client")
    p.add_argument("--store-prefix", default="", help="key prefix in --store")
    p.add_argument("--sharded", action="store_true",
                   help="also prove reduce-scatter, and step with FSDP2")
    add_common_arguments(p)
    return p.parse_args(argv)


def probe(args: argparse.Namespace, report: dict[str, Any]) -> None:
    rank, world = args.rank, args.world_size
    progress = ProgressWriter(args.progress)
    marks: dict[str, float] = {}
    fault = fault_for(rank, os.environ, args.backend)
    import torch
    import torch.distributed as dist

    progress.phase(IMPORTED)
    distributed = args.backend in PROCESS_GROUP_BACKENDS
    if args.backend == "nccl" and not dist.is_nccl_available():
        raise ProbeFailure("backend_unavailable",
                           f"torch {torch.__version__} was built without NCCL")
    device = _device(torch, args, rank)
    progress.phase(DEVICE_READY)
    if device.type == "cpu" and world > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as torchrun does
    if args.backend == "nccl":
        _nccl_diagnostics(torch, report)
    if distributed:
        progress.phase(COMM_SETUP)
        act_on_fault(fault, rank, "hang_setup")
        _init(torch, dist, args, device, report, fault)
        progress.phase(COMM_READY)
    act_on_fault(fault, rank)
    parts = [f"{args.backend} x{world} on {device}"]
    coll = _Collectives(torch, dist, device, rank, world, progress, fault)
    if distributed:
        sizes = check_sizes(args.check_bytes)
        for nbytes in sizes:
            coll.checked(nbytes, CHECK_ITERS)
        marks["checked"] = time.monotonic()
        parts.append(f"all-reduce exact at {len(sizes)} sizes "
                     f"({human(min(sizes))}..{human(max(sizes))}) x{CHECK_ITERS}")
        if world > 1:
            per_op, noise = coll.checked(args.message_bytes, ITERS, warmup=WARMUP)
            nbytes = _numel(args.message_bytes) * 4
            bus = record_bandwidth(report, args.message_bytes, nbytes, per_op, noise, world)
            parts.append(f"{bus}, exact")
            marks["measured"] = time.monotonic()
        # what else training issues: broadcast (DDP's start, checkpoints) and all-gather
        # (metrics, checkpoint metadata; FSDP2's parameters), at the same sizes
        for nbytes in sizes:
            coll.broadcasted(nbytes, OTHER_ITERS)
            coll.gathered(nbytes, OTHER_ITERS)
        parts.append(f"broadcast and all-gather exact at {len(sizes)} sizes")
        if args.sharded:
            for nbytes in sizes:
                coll.scattered(nbytes, CHECK_ITERS)
            parts.append(f"reduce-scatter exact at {len(sizes)} sizes")
        marks["collectives"] = time.monotonic()
    if args.train_step:
        seconds = _train_step(torch, device, coll if distributed else None,
                              sharded=args.sharded and distributed)
        report["step_seconds"] = round(seconds, 6)
        parts.append(f"step {seconds * 1e3:.1f} ms")
        marks["stepped"] = time.monotonic()
    progress.phase(FINISHED)
    report["phase_at"] = {**progress.marks, **marks}
    # No destroy_process_group: teardown is not what a probe proves (training's is bounded by
    # its own shutdown), and NCCL's took 0.41 s of a 2.1 s probe on an H200 host. The worker
    # exits at once after its report (`run_worker`), its communicator ending with the process
    # as a killed worker's does (NCCL unlinks its shared-memory segments once its peers opened
    # them; `benchmarks/gpu_goodput.sh` counts /dev/shm's before and after its runs).
    report["detail"] = "; ".join(parts)


def _numel(nbytes: int) -> int:
    return max(1, nbytes // 4)


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
    torch.zeros(1, device=f"cuda:{index}")  # initialize the context now: "device ready"
    return torch.device("cuda", index)


def store_uses_libuv(env: Mapping[str, str], platform: str = sys.platform) -> bool:
    """Whether torch's own rendezvous (``env://``, ``tcp://``, torchrun's agent store) makes a
    libuv TCPStore: ``USE_LIBUV`` when set ("1": yes), else yes except on Windows, whose builds
    lack libuv. torch >= 2.4 ``torch/distributed/rendezvous.py`` (``_get_use_libuv_from_query_dict``)
    and ``torch/distributed/elastic/utils/distributed.py`` (``create_c10d_store``); the TCPStore
    API (https://pytorch.org/docs/main/distributed.html#torch.distributed.TCPStore, ``use_libuv``)
    and https://pytorch.org/tutorials/intermediate/TCPStore_libuv_backend.html (libuv the
    default server since 2.4, ``USE_LIBUV=0`` for the legacy one)."""
    return env.get("USE_LIBUV", "0" if platform == "win32" else "1") == "1"


#: The file in the probe's run directory where rank 0 publishes its store's port.
STORE_PORT_FILE = "store-port.json"
_POLL_S = 0.02


def _rendezvous(dist: Any, args: argparse.Namespace, fault: str) -> tuple[Any, bool | None]:
    """This rank's connection to the probe's TCPStore, hosted by rank 0 on a port the kernel
    picked (on loopback only where torch takes a listening socket: `_tcp_store`) and published
    in ``--rendezvous``; every wait ends by ``--timeout``. With it, whether the server listens on
    loopback only (rank 0), None on the other ranks."""
    timeout = timedelta(seconds=args.timeout)
    libuv = store_uses_libuv(os.environ)
    act_on_fault(fault, args.rank, "hang_rendezvous")  # rank 0: never publishes; others: never join
    published = Path(args.rendezvous) / STORE_PORT_FILE
    if args.rank == 0:
        store, loopback = _tcp_store(dist, 0, args.world_size, True, timeout, libuv)
        write_json_atomic(published, {"port": int(store.port)}, durable=False,
                          what="the probe's rendezvous")
        return store, loopback
    deadline = time.monotonic() + args.timeout
    while True:
        try:
            port = read_json(published, max_bytes=1024).get("port")
            break
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise ProbeFailure("timeout", f"rank 0 published no store within "
                                   f"{args.timeout:g} s") from None
            time.sleep(_POLL_S)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ProbeFailure("worker_error", f"rank 0 published no valid store port: {port!r}")
    return _tcp_store(dist, port, args.world_size, False, timeout, libuv)


def loopback_listener() -> tuple[int, int]:
    """A TCP socket bound to 127.0.0.1 on a port the kernel picks, listening: (port, its file
    descriptor, detached: the store that takes it closes it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(socket.SOMAXCONN)
        port = int(sock.getsockname()[1])
    except BaseException:
        sock.close()
        raise
    return port, sock.detach()


def _tcp_store(dist: Any, port: int, world: int, host: bool, timeout: timedelta,
               libuv: bool) -> tuple[Any, bool | None]:
    """A TCPStore on loopback, and whether its server listens on loopback only (None: this rank
    is a client); ``use_libuv`` where this torch takes it (>= 2.3). Every rank of this probe
    runs on this host and joins rank 0's server at 127.0.0.1, but torch binds its server to
    every interface whatever ``host_name`` says (seen on torch 2.13, both servers: ``::``), so
    rank 0 hands it a socket of its own bound to 127.0.0.1 (``master_listen_fd``: both servers
    take it, and close it with the store). A torch without that argument hosts the store as
    before, on every interface (False)."""
    if not host:
        return _tcp_store_of(dist, port, world, False, timeout, libuv, {}), None
    port, fd = loopback_listener()
    try:
        store = _tcp_store_of(dist, port, world, True, timeout, libuv,
                              {"wait_for_workers": False, "master_listen_fd": fd})
    except TypeError:  # no master_listen_fd in this torch: every interface, as before
        os.close(fd)
        return _tcp_store_of(dist, 0, world, True, timeout, libuv,
                             {"wait_for_workers": False}), False
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    return store, True


def _tcp_store_of(dist: Any, port: int, world: int, host: bool, timeout: timedelta,
                  libuv: bool, kwargs: dict[str, Any]) -> Any:
    try:
        return dist.TCPStore("127.0.0.1", port, world, host, timeout, use_libuv=libuv, **kwargs)
    except TypeError:  # a torch older than use_libuv: its one server
        return dist.TCPStore("127.0.0.1", port, world, host, timeout, **kwargs)


def _init(torch: Any, dist: Any, args: argparse.Namespace, device: Any,
          report: dict[str, Any], fault: str = "") -> None:
    kwargs: dict[str, Any] = {
        "backend": args.backend, "rank": args.rank,
        "world_size": args.world_size, "timeout": timedelta(seconds=args.timeout),
    }
    if args.store:
        host, _, port = args.store.rpartition(":")
        client = dist.TCPStore(host.strip("[]"), int(port), is_master=False,
                               timeout=timedelta(seconds=args.timeout), wait_for_workers=False)
        kwargs["store"] = dist.PrefixStore(args.store_prefix, client)
    elif args.rendezvous:
        store, loopback = _rendezvous(dist, args, fault)
        report["rendezvous"] = {"store": "TCPStore",
                                "libuv": bool(getattr(store, "libuvBackend", False))}
        if loopback is not None:
            report["rendezvous"]["loopback_only"] = loopback
        kwargs["store"] = dist.PrefixStore("default_pg", store)  # as init_process_group does
    else:
        raise ProbeFailure("worker_error", "a process group needs --rendezvous or --store")
    if args.backend == "nccl" and "device_id" in inspect.signature(
            dist.init_process_group).parameters:
        kwargs["device_id"] = device  # creates the communicator now: errors surface at init
    dist.init_process_group(**kwargs)


def _nccl_diagnostics(torch: Any, report: dict[str, Any]) -> None:
    """Before the communicator exists: NCCL's connections formed at init, and its own diagnostics
    on, where the NCCL loaded has them and the environment does not say otherwise (see
    `resilient_strategy.core.knowledge.nccldiag`); what was set and kept goes into the report."""
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return
    chosen = diagnostic_env(version, os.environ)
    os.environ.update(dict(chosen.set))
    report["nccl_diagnostics"] = {
        "version": ".".join(map(str, chosen.version or ())),
        "set": [f"{k}={v}" for k, v in chosen.set], "kept": list(chosen.kept)}


def _sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Collectives:
    """Every collective of the probe, numbered and reported to the runner as it runs."""

    def __init__(self, torch: Any, dist: Any, device: Any, rank: int, world: int,
                 progress: ProgressWriter, fault: str) -> None:
        self.torch, self.dist, self.device = torch, dist, device
        self.rank, self.world, self.progress, self.fault = rank, world, progress, fault
        self.k = 0
        self.started: set[str] = set()

    @contextlib.contextmanager
    def region(self, nbytes: int, allow_s: float = 0.0) -> Iterator[None]:
        """One numbered collective (or a step that runs them), synchronized before it ends."""
        self.k += 1
        self.progress.enter(self.k, nbytes, allow_s=allow_s)
        if self.k == 1:
            act_on_fault(self.fault, self.rank, "hang_collective")
        yield
        _sync(self.torch, self.device)
        self.progress.leave(self.k, nbytes)

    def checked(self, nbytes: int, iters: int, warmup: int = 0) -> tuple[float, float]:
        """``warmup + iters`` all-reduces of ``nbytes``, each checked exactly; the mean seconds
        of the timed ones (the all-reduce and its synchronization only)."""
        torch, rank, world = self.torch, self.rank, self.world
        numel = _numel(nbytes)
        # integers 1..PATTERN_MOD: with the multipliers below every sum stays below 2**24
        pattern = (torch.arange(numel, dtype=torch.int32) % PATTERN_MOD + 1).to(
            torch.float32).to(self.device)
        buf = torch.empty_like(pattern)
        times: list[float] = []
        # a data fault floored at N bytes (``wrong:1:nccl:>=N``) spares the smaller sizes
        fault = self.fault if corrupts(self.fault, os.environ, numel * 4) else ""
        for it in range(warmup + iters):
            torch.mul(pattern, float(contribution(rank, world, it)), out=buf)
            if fault == "wrong":
                buf[numel // 2] += 1.0
            elif fault == "nan":
                buf[numel // 3] = float("nan")
            _sync(torch, self.device)
            t0 = time.perf_counter()
            # NCCL connects lazily per algorithm: a new size may set up a new one (NVLS, tree)
            with self.region(numel * 4, NEW_SIZE_ALLOW_S if it == 0 else 0.0):
                self.dist.all_reduce(buf)
            if it >= warmup:
                times.append(time.perf_counter() - t0)
            if fault == "zero":
                buf[numel // 4: numel // 2] = 0.0
            expected = pattern * float(expected_sum(world, it))
            if not torch.equal(buf, expected):
                _mismatch(torch, buf.cpu(), expected.cpu(), numel, world, it)
        return sum(times) / max(1, len(times)), spread(times)

    def _chunks(self, nbytes: int) -> tuple[int, Any]:
        """Elements per rank for ``nbytes`` in all, and the pattern of the whole buffer."""
        torch = self.torch
        per = max(1, _numel(nbytes) // self.world)
        whole = (torch.arange(per * self.world, dtype=torch.int32) % PATTERN_MOD + 1).to(
            torch.float32).to(self.device)
        return per, whole

    def _first(self, what: str) -> None:
        """Hang here when told to (``hang_<what>``), once: inside the first collective of its kind."""
        if what not in self.started:
            self.started.add(what)
            act_on_fault(self.fault, self.rank, f"hang_{what}")

    def _broken(self, kind: str, nbytes: int) -> bool:
        """Whether the ``wrong_<kind>`` fault corrupts a collective of ``nbytes`` here."""
        return self.fault == f"wrong_{kind}" and corrupts("wrong", os.environ, nbytes)

    def broadcasted(self, nbytes: int, iters: int) -> None:
        """Broadcasts of ``nbytes`` (DDP's parameter sync, a checkpoint or a metric from one
        rank), from root ``it % world`` in iteration ``it``: the root sends the pattern times its
        contribution, every rank must hold exactly that afterwards."""
        torch, rank, world = self.torch, self.rank, self.world
        numel = _numel(nbytes)
        pattern = (torch.arange(numel, dtype=torch.int32) % PATTERN_MOD + 1).to(
            torch.float32).to(self.device)
        buf = torch.empty_like(pattern)
        wrong = self._broken("broadcast", numel * 4)
        for it in range(iters):
            root = it % world
            expected = pattern * float(contribution(root, world, it))
            if rank == root:
                buf.copy_(expected)
            else:
                buf.fill_(-1.0)  # a receive that never lands shows
            with self.region(numel * 4, NEW_SIZE_ALLOW_S if it == 0 else 0.0):
                self._first("broadcast")
                self.dist.broadcast(buf, src=root)
            if wrong:
                buf[numel // 2] += 1.0
            if not torch.equal(buf, expected):
                _mismatch(torch, buf.cpu(), expected.cpu(), numel, world, it,
                          f"broadcast from rank {root}")

    def gathered(self, nbytes: int, iters: int) -> None:
        """All-gathers of ``nbytes`` in all (metrics, checkpoint metadata; FSDP2 gathers a
        unit's parameters so): rank r sends its chunk of the pattern times its contribution;
        each chunk must land in place."""
        torch, rank, world = self.torch, self.rank, self.world
        per, whole = self._chunks(nbytes)
        gather = getattr(self.dist, "all_gather_single", None) or self.dist.all_gather_into_tensor
        out = torch.empty_like(whole)
        wrong = corrupts(self.fault, os.environ, per * world * 4) and self.fault == "wrong"
        broken = self._broken("gather", per * world * 4)
        for it in range(iters):
            mine = whole[rank * per:(rank + 1) * per] * float(contribution(rank, world, it))
            if wrong:
                mine[per // 2] += 1.0
            with self.region(per * world * 4, NEW_SIZE_ALLOW_S if it == 0 else 0.0):
                self._first("gather")
                gather(out, mine.contiguous())
            if broken:  # a peer's chunk that arrived wrong
                out[((rank + 1) % world) * per + per // 2] += 1.0
            # chunk r must be contribution(r, world, it) x its piece of the pattern: checked
            # chunk by chunk (one pass over the data); the whole expected buffer only on a miss
            if not all(torch.equal(out[r * per:(r + 1) * per],
                                   whole[r * per:(r + 1) * per] * float(contribution(r, world, it)))
                       for r in range(world)):
                scale = torch.repeat_interleave(
                    torch.arange(world, dtype=torch.float32), per).to(self.device)
                expected = whole * (scale + 1 + it * world)
                _mismatch(torch, out.cpu(), expected.cpu(), per * world, world, it,
                          "all-gather")

    def scattered(self, nbytes: int, iters: int) -> None:
        """Reduce-scatters of ``nbytes`` in all (FSDP2 reduces gradients so): every rank sends
        the whole pattern times its contribution; rank r must get the sum of its chunk."""
        torch, rank, world = self.torch, self.rank, self.world
        per, whole = self._chunks(nbytes)
        scatter = getattr(self.dist, "reduce_scatter_single", None) \
            or self.dist.reduce_scatter_tensor
        out = torch.empty(per, dtype=torch.float32, device=self.device)
        wrong = corrupts(self.fault, os.environ, per * world * 4) and self.fault == "wrong"
        for it in range(iters):
            sent = whole * float(contribution(rank, world, it))
            if wrong:
                sent[per // 2] += 1.0
            with self.region(per * world * 4, NEW_SIZE_ALLOW_S if it == 0 else 0.0):
                scatter(out, sent)
            expected = whole[rank * per:(rank + 1) * per] * float(expected_sum(world, it))
            if not torch.equal(out, expected):
                _mismatch(torch, out.cpu(), expected.cpu(), per, world, it, "reduce-scatter")


def _mismatch(torch: Any, got: Any, expected: Any, numel: int, world: int, it: int,
              what: str = "all-reduce") -> None:
    bad = (got != expected).nonzero().flatten()
    i = int(bad[0])
    where = (f"{what} of {numel} float32 ({human(numel * 4)}) over {world} ranks, "
             f"iteration {it + 1}: {len(bad)} values wrong, first at index {i}: "
             f"{float(got[i])!r} instead of {float(expected[i])!r}")
    nans = int(torch.isnan(got).sum())
    zeros = int(((got == 0) & (expected != 0)).sum())
    raise mismatch_failure(where, nans, zeros)


def _train_step(torch: Any, device: Any, coll: _Collectives | None,
                sharded: bool = False) -> float:
    """One warm-up step, then the time of a second; with ``coll``, DDP's collectives (``sharded``:
    FSDP2) and a parameter check."""
    rank, world = (coll.rank, coll.world) if coll is not None else (0, 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 16)
    ).to(device)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    region = coll.region if coll is not None else _no_region
    net = model
    if coll is not None and sharded:
        # FSDP2 shards the parameters. Its import (torch._dynamo, sympy: 2-8 s on a loaded
        # host) happens inside the region: outside any, a rank silent that long is judged hung.
        with region(nbytes, STEP_ALLOW_S):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (world,))
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh)
            net = fully_shard(model, mesh=mesh)
    elif coll is not None:
        with region(nbytes, STEP_ALLOW_S):  # as DDP does: rank 0's parameters everywhere
            for p in model.parameters():
                coll.dist.broadcast(p.data, src=0)
    # plain SGD by hand: constructing a torch.optim optimizer imports torch._dynamo (~2 s)
    params = list(net.parameters())
    bucketed = coll is not None and not sharded and world > 1
    gen = torch.Generator().manual_seed(rank + 1)
    x = torch.randn(32, 64, generator=gen).to(device)
    y = torch.randn(32, 16, generator=gen).to(device)

    def step() -> float:
        for p in params:
            p.grad = None
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        if bucketed:  # DDP's reduction: one flat bucket, summed, averaged
            assert coll is not None
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            coll.dist.all_reduce(flat)
            flat /= world
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-0.1)
        return float(loss.detach())  # waits for the device

    with region(nbytes, STEP_ALLOW_S):  # the first step (FSDP2: lazy initialisation)
        step()
    t0 = time.perf_counter()
    with region(nbytes):
        loss = step()
    _sync(torch, device)
    seconds = time.perf_counter() - t0
    if not math.isfinite(loss):
        raise ProbeFailure("nan_result" if math.isnan(loss) else "wrong_result",
                           f"training step gave a non-finite loss {loss}")
    if coll is not None and world > 1:
        dist = coll.dist
        with region(nbytes):  # sharded: gathering the full parameters is a collective
            full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
        sums = torch.stack([p.detach().double().sum() for p in full]).to(device)
        hi, lo = sums.clone(), sums.clone()
        with region(hi.numel() * 8):
            dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        with region(lo.numel() * 8):
            dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        if not torch.equal(hi, lo):
            raise ProbeFailure("wrong_result", f"after a {'FSDP2' if sharded else 'data-parallel'} step "
                               "the parameters differ between ranks")
    return seconds


@contextlib.contextmanager
def _no_region(nbytes: int, allow_s: float = 0.0) -> Iterator[None]:
    yield


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    watch_parent(args.parent_pid)
    run_worker(args.report, lambda report: probe(args, report))


if __name__ == "__main__":
    main()
