"""The default ladder's worst case on real GPUs: every multi-replica candidate hangs in its first
collective (issue 21, item 4: <= 30 s on a 4-GPU machine; the testing kit simulates it in
``bench_ladder.py``, this measures it).

    python benchmarks/gpu_ladder.py [--gpus 4] [--repeat 2] [--timeout 30]

A cold decision for a torchrun job of ``--gpus`` ranks (this process stands in for rank 0 of the
launch, as ``bench_floor.py`` does on CPU), with ``RESILIENT_STRATEGY_PROBE_FAULT=hang_collective:1``:
rank 1 of every probe with a process group hangs inside collective 1, so NCCL, its remedies and
gloo each hang until the prober cuts them; the one-GPU candidate has no collective and passes.
Prints each probe (status, seconds), the choice, the decision's time and the simulated time of
the same machine from the testing kit, with their ratio. Without enough GPUs it says "skipped".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args()
    from resilient_strategy import resilient_strategy
    from resilient_strategy.machine.inspect import detect_facts
    from resilient_strategy.testing.fakes import simulate
    from resilient_strategy.testing.simulation import SimulatedProber

    facts = detect_facts()
    if len(facts.gpus) < args.gpus:
        print(f"skipped: {len(facts.gpus)} GPU(s) seen, {args.gpus} needed")
        return 0
    n = args.gpus
    env = {k: v for k, v in os.environ.items() if k != "RESILIENT_STRATEGY_PROBE_FAULT"}
    env.update({"WORLD_SIZE": str(n), "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(n),
                "MASTER_PORT": "0", "RESILIENT_STRATEGY_PROBE_FAULT": "hang_collective:1"})
    kw = dict(framework="torch", global_batch_size=256, probe="force", timeout=args.timeout)
    times: list[float] = []
    last = None
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as cache:
            t = time.perf_counter()
            last = resilient_strategy(**kw, cache_dir=cache, env=env)  # type: ignore[arg-type]
            times.append(time.perf_counter() - t)
    assert last is not None
    probes = last.to_dict()["probes"]
    sim_env = {k: v for k, v in env.items() if k != "RESILIENT_STRATEGY_PROBE_FAULT"}
    # as bench_ladder.py simulates it: every multi-replica candidate hangs, one replica works
    prober = SimulatedProber(default="timeout", outcomes={"single_device": "ok", "cpu": "ok"})
    sim_sel = simulate(detect_facts(sim_env), prober, env=sim_env, **kw)  # type: ignore[arg-type]
    sim_s = prober.clock()
    real = statistics.median(times)
    print(f"{facts.gpus[0].name} x{len(facts.gpus)}, {n} ranks, probe timeout {args.timeout:g} s")
    print("| measurement | value |\n|---|---|")
    print(f"| real cold decision, every multi-replica candidate hanging (median of {len(times)}) "
          f"| {real:.1f} s (runs {', '.join(f'{x:.1f}' for x in times)}) |")
    for key, p in probes.items():
        print(f"| probe {key} | {p['status']} {p['cause']} in {p['elapsed_s']:.1f} s |")
    print(f"| chosen | {last.candidate.label} |")
    print(f"| simulated (testing kit), same facts | {sim_s:.1f} s, {sim_sel.candidate.label} |")
    print(f"| real / simulated | {real / sim_s:.2f} (goal within 25%) |")
    print(f"| goal <= 30 s | {'met' if real <= 30 else 'NOT met'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
