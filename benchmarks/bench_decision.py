"""How long a decision takes: import, inspection, cold probe, cached decision, and the time to a
working strategy when a collective hangs, next to torch's default NCCL timeout (10 minutes).

    python benchmarks/bench_decision.py [--timeout 10] [--repeat 5]

Runs on any machine: with 2+ GPUs it probes NCCL as local rank 0 of a simulated torchrun launch
(WORLD_SIZE = number of GPUs); without GPUs it probes gloo between 2 CPU processes, and
TensorFlow on 2 logical CPU devices when TensorFlow is installed. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SRC = str(Path(__file__).resolve().parents[1] / "src")
sys.path.insert(0, SRC)

import resilient_strategy  # noqa: E402
from resilient_strategy.inspect import detect_facts  # noqa: E402

TORCH_DEFAULT_NCCL_TIMEOUT_S = 600.0


def _import_ms(code: str, repeat: int) -> float:
    env = {**os.environ, "PYTHONPATH": SRC}
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _decide(**kw: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    sel = resilient_strategy.resilient_strategy(**kw)
    return sel, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per probe")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    rows: list[tuple[str, str, str, str]] = []
    bare = _import_ms("pass", args.repeat)
    ours = _import_ms("import resilient_strategy", args.repeat)
    rows.append(("import resilient_strategy (median, fresh process)",
                 f"{ours:.0f} ms", f"bare python {bare:.0f} ms: +{ours - bare:.0f} ms", ""))
    t = time.perf_counter()
    facts = detect_facts()
    rows.append(("detect_facts() (NVML, host, frameworks; no import)",
                 f"{(time.perf_counter() - t) * 1e3:.0f} ms", f"{len(facts.gpus)} GPU(s)", ""))

    n = len(facts.gpus)
    world = n if n >= 2 else 2
    launch = {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0", "MASTER_PORT": "0"}
    what = f"NCCL on {n} GPUs" if n >= 2 else "gloo on 2 CPU processes"
    hang_backend = "nccl" if n >= 2 else "gloo"
    with tempfile.TemporaryDirectory() as cache:
        base: dict[str, Any] = {"framework": "torch", "global_batch_size": 64 * world,
                                "timeout": args.timeout, "cache_dir": cache}
        env = {**os.environ, **launch}
        sel, cold = _decide(probe="force", env=env, **base)
        rows.append((f"cold decision, probing {what}", f"{cold:.2f} s", sel.candidate.label,
                     ", ".join(f"{r.status} {r.elapsed_s:.1f}s"
                               + (f" {r.bus_bandwidth_gbps:.1f}GB/s" if r.bus_bandwidth_gbps else "")
                               for r in sel.results.values())))
        warm = []
        for _ in range(args.repeat):
            sel2, dt = _decide(env=env, **base)
            warm.append(dt)
        rows.append(("cached decision (same machine, same options)",
                     f"{statistics.median(warm) * 1e3:.1f} ms", sel2.candidate.label,
                     f"from cache: {sel2.from_cache}"))
        hang_env = {**env, "RESILIENT_STRATEGY_PROBE_FAULT": f"hang:1:{hang_backend}"}
        sel3, hung = _decide(probe="force", env=hang_env, **base)
        rows.append((f"{hang_backend} hangs (rank 1 stalls before the collective), "
                     f"timeout {args.timeout:g} s",
                     f"{hung:.2f} s", sel3.candidate.label,
                     f"torch's default NCCL timeout: {TORCH_DEFAULT_NCCL_TIMEOUT_S:.0f} s "
                     f"({TORCH_DEFAULT_NCCL_TIMEOUT_S / hung:.0f}x longer), then a crash"))
        if facts.framework("tensorflow").installed and n < 2:
            sel4, tf_cold = _decide(framework="tensorflow", global_batch_size=256, logical_cpus=2,
                                    probe="force", timeout=max(args.timeout, 30), cache_dir=cache,
                                    env=dict(os.environ))
            rows.append(("cold decision, TensorFlow on 2 logical CPUs (NCCL fails at fit)",
                         f"{tf_cold:.2f} s", sel4.candidate.label,
                         ", ".join(f"{k.split(':')[1]} {r.status} {r.elapsed_s:.1f}s"
                                   for k, r in sel4.results.items())))

    print(f"\nresilient_strategy {resilient_strategy.__version__}, python "
          f"{sys.version.split()[0]}, {os.cpu_count()} CPUs, {n} GPU(s)"
          + (f" ({facts.gpus[0].name})" if n else ""))
    print("| measurement | time | choice | detail |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
