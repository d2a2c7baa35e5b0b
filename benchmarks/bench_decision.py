"""How long a decision takes: import, inspection, cold probe, cached decision, and the time to a
working strategy when a collective hangs, next to torch's default NCCL timeout (10 minutes).

    python benchmarks/bench_decision.py [--timeout 30] [--repeat 5] [--phases]

Runs on any machine: with 2+ GPUs it probes NCCL as local rank 0 of a simulated torchrun launch
(WORLD_SIZE = number of GPUs); without GPUs it probes gloo between 2 CPU processes, and
TensorFlow on 2 logical CPU devices when TensorFlow is installed. Prints a markdown table, with
the issue-10 goals checked: a hanging probe reaches a working decision in at most 3x the time of
a healthy cold decision, and a healthy cold decision takes at most 3 s on CPU (5 s on 2 GPUs).
Cold decisions are measured with the fork server (the default) and without it
(RESILIENT_STRATEGY_FORKSERVER=0); ``--phases`` adds a row per phase of a hang (before the
collective, inside it, in communicator setup).
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
from resilient_strategy.machine.inspect import detect_facts  # noqa: E402

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
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per probe (default 30)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--phases", action="store_true", help="time each phase of a hang too")
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

    from resilient_strategy.records.progress import ProgressWriter, StallWatcher

    with tempfile.TemporaryDirectory() as tmp:
        writer = ProgressWriter(os.path.join(tmp, "p"))
        calls = 20000
        t = time.perf_counter()
        for k in range(calls):
            writer.step(k)
        per_write = (time.perf_counter() - t) / calls
        watcher = StallWatcher([os.path.join(tmp, "p")] * 8)
        t = time.perf_counter()
        for _ in range(2000):
            watcher.poll()
        per_poll = (time.perf_counter() - t) / 2000
        writer.close()
    rows.append(("progress record: ProgressWriter.step() (a store into a shared mapping)", f"{per_write * 1e6:.1f} us",
                 "per call, cheap enough per training step",
                 f"StallWatcher.poll() over 8 ranks: {per_poll * 1e6:.0f} us"))

    n = len(facts.gpus)
    world = n if n >= 2 else 2
    launch = {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0", "MASTER_PORT": "0"}
    what = f"NCCL on {n} GPUs" if n >= 2 else "gloo on 2 CPU processes"
    hang_backend = "nccl" if n >= 2 else "gloo"
    with tempfile.TemporaryDirectory() as cache:
        base: dict[str, Any] = {"framework": "torch", "global_batch_size": 64 * world,
                                "timeout": args.timeout, "cache_dir": cache}
        env = {k: v for k, v in {**os.environ, **launch}.items()
               if k not in ("RESILIENT_STRATEGY_PROBE_FAULT", "RESILIENT_STRATEGY_FORKSERVER")}
        colds: dict[str, list[float]] = {"1": [], "0": []}
        sel: Any = None
        for _ in range(max(1, args.repeat // 2)):  # interleaved: load drifts on a shared host
            for fs in ("1", "0"):
                sel, dt = _decide(probe="force", env={**env, "RESILIENT_STRATEGY_FORKSERVER": fs},
                                  **base)
                colds[fs].append(dt)
        cold = statistics.median(colds["1"])
        fresh = statistics.median(colds["0"])
        rows.append((f"cold decision, probing {what} (median of {len(colds['1'])})",
                     f"{cold:.2f} s", sel.candidate.label,
                     ", ".join(f"{r.status} {r.elapsed_s:.1f}s"
                               + (f" {r.bus_bandwidth_gbps:.1f}GB/s" if r.bus_bandwidth_gbps else "")
                               for r in sel.results.values())
                     + f"; goal <= {3 if n < 2 else 5} s"))
        rows.append(("same, each worker a fresh interpreter (RESILIENT_STRATEGY_FORKSERVER=0)",
                     f"{fresh:.2f} s", sel.candidate.label,
                     f"forking here saves {fresh - cold:.2f} s ({(fresh - cold) / fresh:.0%})"))
        if n < 2:  # a later probe in the same decision (a remedy, the next candidate)
            from resilient_strategy.core.measures.probe import ProbeSpec
            from resilient_strategy.probing.prober import run_probe

            spec = ProbeSpec("torch:gloo:cpu", "torch", "gloo", (), world_size=2,
                             timeout_s=args.timeout)
            later: dict[str, list[float]] = {"1": [], "0": []}
            run_probe(spec, env)  # torch imported here
            for _ in range(max(1, args.repeat // 2)):
                for fs in ("1", "0"):
                    t = time.perf_counter()
                    run_probe(spec, {**env, "RESILIENT_STRATEGY_FORKSERVER": fs})
                    later[fs].append(time.perf_counter() - t)
            a, b = statistics.median(later["1"]), statistics.median(later["0"])
            rows.append(("a later gloo probe in the same decision, forked (torch imported here)",
                         f"{a:.2f} s", f"fresh interpreters: {b:.2f} s",
                         f"saves {b - a:.2f} s ({(b - a) / b:.0%}) per later probe"))
        warm = []
        for _ in range(args.repeat):
            sel2, dt = _decide(env=env, **base)
            warm.append(dt)
        rows.append(("cached decision (same machine, same options)",
                     f"{statistics.median(warm) * 1e3:.1f} ms", sel2.candidate.label,
                     f"from cache: {sel2.from_cache}"))
        faults = [("hang", "rank 1 stalls before the collective")]
        if args.phases:
            faults += [("hang_collective", "rank 1 stalls inside collective 1"),
                       ("hang_setup", "rank 1 stalls inside communicator setup")]
        for fault, words in faults:
            hang_env = {**env, "RESILIENT_STRATEGY_PROBE_FAULT": f"{fault}:1:{hang_backend}"}
            sel3, hung = _decide(probe="force", env=hang_env, **base)
            cut = sel3.results[next(iter(sel3.results))]
            how = dict(cut.extra)
            rows.append((f"{hang_backend} hangs ({words}), timeout {args.timeout:g} s",
                         f"{hung:.2f} s", sel3.candidate.label,
                         f"{hung / cold:.1f}x the cold decision (goal <= 3x); cut after "
                         f"{cut.elapsed_s:.1f} s as a {how.get('hang', 'deadline')} hang at "
                         f"{how.get('hang_at', '?')}; torch's default NCCL timeout: "
                         f"{TORCH_DEFAULT_NCCL_TIMEOUT_S:.0f} s"))
        if facts.framework("tensorflow").installed and n < 2:
            sel4, tf_cold = _decide(framework="tensorflow", global_batch_size=256, logical_cpus=2,
                                    probe="force", timeout=max(args.timeout, 30), cache_dir=cache,
                                    env=dict(os.environ))
            rows.append(("cold decision, TensorFlow on 2 logical CPUs (NCCL is not tried there)",
                         f"{tf_cold:.2f} s", sel4.candidate.label,
                         ", ".join(f"{k.split(':')[1]} {r.status} {r.elapsed_s:.1f}s"
                                   for k, r in sel4.results.items())))

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nresilient_strategy {resilient_strategy.__version__}, python "
          f"{sys.version.split()[0]}, {os.cpu_count()} CPUs (load average {load:.1f}), {n} GPU(s)"
          + (f" ({facts.gpus[0].name})" if n else ""))
    print("| measurement | time | choice | detail |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
