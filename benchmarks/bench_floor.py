"""The physical floor of a probe, measured in the same run as the library's cold decision for the
same candidate, and their ratio (issue 21: cold decision <= 1.25x the floor).

    python benchmarks/bench_floor.py [--repeat 3] [--nproc 2] [--skip-tf]

The floor of a torch probe is what no prober can avoid: N interpreters started in parallel, each
importing torch, initialising the backend (gloo on CPU; NCCL with a 1-rank communicator where a
GPU is present) and running one checked all-reduce at each size the probe checks, then exiting.
Rows:

- import floor: N interpreters importing torch in parallel, nothing else;
- probe floor: the above plus the backend and the checked collectives (all-reduce at every
  size the probe checks, then broadcast and all-gather at the same sizes: the collectives a
  training job issues, proven by every probe since issue 31);
- the library's cold decision (``resilient_strategy(probe="force")``, no cache) probing the same
  candidate, with the fork server (the default) and without it (``RESILIENT_STRATEGY_FORKSERVER=0``);
- on a GPU: ``run_probe`` of NCCL on one GPU against a 1-rank NCCL floor;
- TensorFlow (when installed): one interpreter importing TensorFlow, making 2 logical CPUs and
  running one checked all-reduce under MirroredStrategy, against the library's cold decision on
  2 logical CPUs.

Each library row prints its ratio to the floor and the goal. Medians, interleaved repetitions
(load drifts on a shared host). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SRC = str(Path(__file__).resolve().parents[1] / "src")
sys.path.insert(0, SRC)

from resilient_strategy.probing.workers.common import CHECK_BYTES, CHECK_ITERS  # noqa: E402

GOAL = 1.25

_TORCH_FLOOR = """
import sys, time
import torch, torch.distributed as dist
rank, world, port, backend = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
sizes = [int(x) for x in sys.argv[5].split(",")]
iters = int(sys.argv[6])
if sys.argv[7] == "import":
    sys.exit(0)
dev = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
if backend == "nccl":
    torch.cuda.set_device(0)
store = dist.TCPStore("127.0.0.1", port, world, rank == 0, wait_for_workers=False)
dist.init_process_group(backend, store=store, rank=rank, world_size=world)
for nbytes in sizes:
    for it in range(iters):
        x = torch.full((nbytes // 4,), float(rank + 1 + it * world), device=dev)
        dist.all_reduce(x)
        want = sum(r + 1 + it * world for r in range(world))
        assert bool((x == want).all()), (nbytes, it)
for nbytes in sizes:  # what else training issues: broadcast and all-gather, as the probe checks
    for it in range(iters):
        root = it % world
        x = torch.full((nbytes // 4,), float(rank + 1 + it * world), device=dev)
        dist.broadcast(x, src=root)
        assert bool((x == root + 1 + it * world).all()), (nbytes, it)
        per = max(1, nbytes // 4 // world)
        out = torch.empty(per * world, device=dev)
        dist.all_gather_into_tensor(out, torch.full((per,), float(rank + 1), device=dev))
        assert bool((out == torch.arange(1, world + 1, device=dev).repeat_interleave(per)).all())
dist.destroy_process_group()
"""

_TF_FLOOR = """
import os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
sizes = [int(x) for x in sys.argv[1].split(",")]
iters = int(sys.argv[2])
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
devs = [d.name for d in tf.config.list_logical_devices("CPU")]
strategy = tf.distribute.MirroredStrategy(devs, cross_device_ops=tf.distribute.ReductionToOneDevice())
for nbytes in sizes:
    for it in range(iters):
        def fn():
            ctx = tf.distribute.get_replica_context()
            mine = tf.cast(ctx.replica_id_in_sync_group + 1 + it * 2, tf.float32)
            return ctx.all_reduce("sum", tf.fill([nbytes // 4], mine))
        out = strategy.experimental_local_results(strategy.run(fn))
        want = float(1 + 2 + 2 * it * 2)
        assert all(bool(tf.reduce_all(o == want)) for o in out), (nbytes, it)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _parallel(argvs: list[list[str]], timeout: float = 300.0) -> float:
    """Start every command at once; seconds until the last one exited (each must exit 0)."""
    t = time.perf_counter()
    procs = [subprocess.Popen(a, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for a in argvs]
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"floor process failed ({p.returncode}): {err.decode()[-500:]}")
    return time.perf_counter() - t


def _torch_floor(nproc: int, backend: str, what: str) -> float:
    port = _free_port()
    sizes = ",".join(str(b) for b in CHECK_BYTES)
    return _parallel([[sys.executable, "-c", _TORCH_FLOOR, str(r), str(nproc), str(port), backend,
                       sizes, str(CHECK_ITERS), what] for r in range(nproc)])


def _decide(**kw: Any) -> tuple[Any, float]:
    import resilient_strategy

    t = time.perf_counter()
    sel = resilient_strategy.resilient_strategy(**kw)
    return sel, time.perf_counter() - t


def _phases(sel: Any) -> str:
    """The chosen candidate's probe phases, from the Selection's trace data."""
    probe = sel.to_dict()["probes"].get(sel.candidate.key) or {}
    return ", ".join(f"{k} {v:.2f}" for k, v in probe.get("phases", ()))


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--skip-tf", action="store_true")
    ap.add_argument("--only-tf", action="store_true", help="the TensorFlow rows alone")
    args = ap.parse_args()

    from resilient_strategy.machine.inspect import detect_facts

    facts = detect_facts()
    rows: list[tuple[str, str, str, str]] = []
    env = {k: v for k, v in os.environ.items()
           if k not in ("RESILIENT_STRATEGY_PROBE_FAULT", "RESILIENT_STRATEGY_FORKSERVER")}
    gpus = len(facts.gpus)
    if facts.framework("torch").installed and not args.only_tf:
        # a CPU stand-in on any machine: hide GPUs so the chain is gloo on CPU processes
        cpu_env = {**env, "CUDA_VISIBLE_DEVICES": "", "WORLD_SIZE": str(args.nproc), "RANK": "0",
                   "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(args.nproc), "MASTER_PORT": "0"}
        imports: list[float] = []
        floors: list[float] = []
        colds: dict[str, list[float]] = {"1": [], "0": []}
        phases: dict[str, str] = {"1": "", "0": ""}
        label = ""
        with tempfile.TemporaryDirectory() as cache:
            for i in range(args.repeat):
                imports.append(_torch_floor(args.nproc, "gloo", "import"))
                floors.append(_torch_floor(args.nproc, "gloo", "probe"))
                for fs in ("1", "0") if i % 2 == 0 else ("0", "1"):  # no order effect
                    sel, dt = _decide(framework="torch", global_batch_size=64, probe="force",
                                      cache_dir=cache, env={**cpu_env,
                                                            "RESILIENT_STRATEGY_FORKSERVER": fs})
                    colds[fs].append(dt)
                    label = sel.candidate.label
                    phases[fs] = _phases(sel)
        floor = _median(floors)
        rows.append((f"import floor: {args.nproc} interpreters importing torch in parallel",
                     f"{_median(imports):.2f} s", "", ""))
        rows.append((f"probe floor: + gloo init + checked all-reduce, broadcast and all-gather at "
                     f"{len(CHECK_BYTES)} sizes x{CHECK_ITERS}", f"{floor:.2f} s", "1.00x", ""))
        for fs, words in (("1", "fork server on (default)"), ("0", "fresh interpreters")):
            cold = _median(colds[fs])
            rows.append((f"cold decision, {words}: {label}", f"{cold:.2f} s",
                         f"{cold / floor:.2f}x", f"goal <= {GOAL}x: "
                         + ("met" if cold / floor <= GOAL else "NOT met")))
            rows.append(("  its probe's phases (last run, s from the first worker's start)",
                         "", "", phases[fs]))
    if gpus and facts.framework("torch").installed and not args.only_tf:
        from resilient_strategy.core.measures.probe import ProbeSpec
        from resilient_strategy.probing.prober import run_probe

        spec = ProbeSpec("torch:nccl:0", "torch", "nccl", (0,), world_size=1, timeout_s=60.0)
        nfloor, nlib = [], []
        for _ in range(args.repeat):
            nfloor.append(_torch_floor(1, "nccl", "probe"))
            t = time.perf_counter()
            res = run_probe(spec, env)
            nlib.append(time.perf_counter() - t)
        f, lib = _median(nfloor), _median(nlib)
        rows.append(("NCCL floor: 1 interpreter, torch, a 1-rank communicator, checked all-reduce",
                     f"{f:.2f} s", "1.00x", facts.gpus[0].name))
        rows.append((f"run_probe(NCCL on GPU 0): {res.status}", f"{lib:.2f} s", f"{lib / f:.2f}x",
                     f"goal <= {GOAL}x: " + ("met" if lib / f <= GOAL else "NOT met")))
        rows.append(("  its phases (last run, s from the first worker's start)", "", "",
                     ", ".join(f"{k} {v:.2f}" for k, v in res.phases)))
    if facts.framework("tensorflow").installed and not args.skip_tf:
        tfloor, tcold = [], []
        tf_sizes = ",".join(str(b) for b in CHECK_BYTES)
        tsel = None
        with tempfile.TemporaryDirectory() as cache:
            for _ in range(args.repeat):
                tfloor.append(_parallel([[sys.executable, "-c", _TF_FLOOR, tf_sizes,
                                                  str(CHECK_ITERS)]]))
                tsel, dt = _decide(framework="tensorflow", global_batch_size=256, logical_cpus=2,
                                probe="force", timeout=60, cache_dir=cache,
                                env={**env, "CUDA_VISIBLE_DEVICES": ""})
                tcold.append(dt)
        f, c = _median(tfloor), _median(tcold)
        rows.append(("TF floor: 1 interpreter, TensorFlow, 2 logical CPUs, checked all-reduce "
                     f"at {len(CHECK_BYTES)} sizes x{CHECK_ITERS}",
                     f"{f:.2f} s", "1.00x", ""))
        rows.append(("cold decision, TensorFlow on 2 logical CPUs", f"{c:.2f} s", f"{c / f:.2f}x",
                     f"goal <= {GOAL}x: " + ("met" if c / f <= GOAL else "NOT met")))
        if tsel is not None:
            rows.append(("  its probe's phases (last run, s from the worker's start)", "", "",
                         _phases(tsel)))

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\npython {sys.version.split()[0]}, {os.cpu_count()} CPUs (load average {load:.1f}), "
          f"{gpus} GPU(s), median of {args.repeat}")
    print("| measurement | time | vs floor | note |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
