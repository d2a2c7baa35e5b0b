"""The default ladder's worst case: every multi-replica candidate hangs. Simulated with the testing
kit's clock (the prober's own: start-up, phases, hangs cut by the prober's stall policy, the GPU
health check deferred to one before the decision returns), and for real on CPU, where gloo hanging inside its first
collective (``RESILIENT_STRATEGY_PROBE_FAULT=hang_collective:1:gloo``) stands in for a hung
transport, next to the simulated time for the same machine.

    python benchmarks/bench_ladder.py [--timeout 30] [--repeat 2] [--procs 2,4]

Prints a markdown table with the issue-21 goals checked: the simulated worst case on a 4-GPU
machine (torch under torchrun, 4 ranks) at most 30 s, and the real CPU stand-in within 25% of
its simulation (0.75 <= real / simulated <= 1.25).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SRC = str(Path(__file__).resolve().parents[1] / "src")
sys.path.insert(0, SRC)

import resilient_strategy  # noqa: E402
from resilient_strategy.core.values.facts import Facts  # noqa: E402
from resilient_strategy.machine.inspect import detect_facts  # noqa: E402
from resilient_strategy.probing.cost import Figures  # noqa: E402
from resilient_strategy.testing.fakes import simulate  # noqa: E402
from resilient_strategy.testing.simulation import SimulatedProber, machine  # noqa: E402

SIM_GOAL_S = 30.0
AGREEMENT = 0.25
#: every candidate of one replica works; every multi-replica one hangs (the default outcome)
ONE_REPLICA_OK = {"single_device": "ok", "cpu": "ok"}


def launch(world: int) -> dict[str, str]:
    return {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0", "MASTER_PORT": "0"}


def simulated(facts: Facts, framework: str, env: Mapping[str, str], timeout: float,
              figures: Figures | None = None, **kw: Any) -> tuple[float, Any, SimulatedProber]:
    prober = SimulatedProber(default="timeout", outcomes=dict(ONE_REPLICA_OK), figures=figures)
    sel = simulate(facts, prober, framework=framework, env=dict(env), timeout=timeout, **kw)
    return prober.clock(), sel, prober


def probes(sel: Any, prober: SimulatedProber | None = None) -> str:
    out = ", ".join(f"{k.split(':')[1]}{'+' + k.split(':', 3)[3] if k.count(':') > 2 else ''} "
                    f"{r.status} {r.elapsed_s:.1f}s" for k, r in sel.results.items())
    if prober is not None and prober.health_checks:
        probed = sum(r.elapsed_s for r in sel.results.values())
        checks = "; ".join("GPUs " + ",".join(map(str, g)) for g in prober.health_checks)
        out += (f"; {len(prober.health_checks)} GPU health check(s) ({checks}): "
                f"{prober.clock() - probed:.1f}s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per probe (default 30)")
    ap.add_argument("--repeat", type=int, default=2, help="real decisions per process count")
    ap.add_argument("--procs", default="2,4", help="CPU process counts for the real stand-in")
    args = ap.parse_args()
    rows: list[tuple[str, str, str, str]] = []

    # 1. simulated: a 4-GPU machine, torch (4 ranks under torchrun) and TensorFlow (one process)
    gpus4 = machine(4, env=launch(4), tensorflow="2.15.0", tf_cuda="12.2")
    s, sel, pr = simulated(gpus4, "torch", launch(4), args.timeout, global_batch_size=256)
    rows.append(("simulated: 4 GPUs, torch x4 ranks, every multi-replica candidate hangs",
                 f"{s:.1f} s", sel.candidate.label,
                 f"{probes(sel, pr)}; goal <= {SIM_GOAL_S:g} s: "
                 f"{'met' if s <= SIM_GOAL_S else 'NOT met'}"))
    s, sel, pr = simulated(gpus4, "tensorflow", {}, args.timeout, global_batch_size=256)
    rows.append(("simulated: 4 GPUs, TensorFlow MirroredStrategy, every multi-replica one hangs",
                 f"{s:.1f} s", sel.candidate.label,
                 f"{probes(sel, pr)}; before issue 21 the kit charged 4 x {args.timeout:g} s"))

    # 2. the real CPU stand-in against its simulation on this very machine (typical figures of
    # a CPU machine): each real decision is cold (its fork server started afresh, as in a new
    # training process)
    here = detect_facts()
    base_env = {k: v for k, v in os.environ.items()
                if k not in ("RESILIENT_STRATEGY_PROBE_FAULT", "WORLD_SIZE", "RANK",
                             "LOCAL_RANK", "MASTER_PORT")}
    for world in (int(p) for p in args.procs.split(",") if p.strip()):
        env = {**base_env, **launch(world)}
        facts = detect_facts(env)
        kw: dict[str, Any] = {"global_batch_size": 64 * world}
        sim, sim_sel, _ = simulated(facts, "torch", env, args.timeout, **kw)
        reals: list[float] = []
        real_sel: Any = None
        for _ in range(max(1, args.repeat)):
            with tempfile.TemporaryDirectory() as cache:
                hang = {**env, "RESILIENT_STRATEGY_PROBE_FAULT": "hang_collective:1:gloo"}
                t = time.perf_counter()
                real_sel = resilient_strategy.resilient_strategy(
                    framework="torch", probe="force", cache_dir=cache, env=hang,
                    timeout=args.timeout, **kw)
                reals.append(time.perf_counter() - t)
        real = statistics.median(reals)
        rows.append((f"simulated: this CPU machine, gloo x{world} processes hangs",
                     f"{sim:.1f} s", sim_sel.candidate.label, probes(sim_sel)))
        ratio = real / sim
        rows.append((f"real: gloo x{world} hangs in collective 1 (median of {len(reals)}, cold)",
                     f"{real:.1f} s", real_sel.candidate.label,
                     f"{probes(real_sel)}; runs {', '.join(f'{r:.1f}' for r in reals)} s; "
                     f"real / simulated = {ratio:.2f} (goal within {AGREEMENT:.0%}: "
                     f"{'met' if abs(ratio - 1) <= AGREEMENT else 'NOT met'})"))

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nresilient_strategy {resilient_strategy.__version__}, python "
          f"{sys.version.split()[0]}, {os.cpu_count()} CPUs (load average {load:.1f}), "
          f"{len(here.gpus)} GPU(s), probe timeout {args.timeout:g} s")
    print("| measurement | time | choice | detail |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
