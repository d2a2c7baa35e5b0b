"""How planning grows with the GPU count: simulated machines from 8 to 1,024 GPUs, on one node
and spread over many, no GPU needed.

    python benchmarks/bench_plan.py [--repeat 5] [--max-gpus 1024] [--src PATH]

Columns: GPUs the job uses, nodes, the links the facts hold (one per pair of GPUs on this node up
to 16 GPUs; past that a uniform fabric is held once, with the pairs that differ listed),
the first ``plan()`` on a Facts value (it indexes the links once), the median of later ones (the
planner runs once per probe round), and a whole simulated decision on a new Facts value
(``testing.simulate``: options, fingerprint, every plan round, probes answered from a table). ``--src`` runs
the same rows against another checkout's ``src`` (to compare with the code before a change).
Prints a markdown table. Then the field catalogue (``examples/machines/field``, issue 19): the
time to decide every case (probes answered from each case's reported outcomes, none run), the
largest number of probes any case spends before its decision, the cases per family, the causes
in the signature table, the remedies, and how many cases keep NCCL at full replica count.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any


def _median_s(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--max-gpus", type=int, default=1024)
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    args = ap.parse_args()
    sys.path.insert(0, args.src)

    from resilient_strategy.core.knowledge.rules import load_rules
    from resilient_strategy.core.planning.plan import plan
    from resilient_strategy.testing import machine, simulate

    try:
        from resilient_strategy.core.call.options import Options as policy_of
    except ImportError:  # before options.py existed
        from resilient_strategy.core.planning.plan import Policy as policy_of  # type: ignore[attr-defined,no-redef]

    rules = load_rules([], [])
    rows = []
    # (GPUs, nodes, one pair without NVLink: the facts list it beside the fabric)
    shapes = [(n, 1, False) for n in (8, 64, 256, 1024)] + [(1024, 1, True), (1024, 128, False),
                                                            (1024, 16, False)]
    for total, nodes, odd_pair in shapes:
        if total > args.max_gpus:
            continue
        local = total // nodes
        env = {"WORLD_SIZE": str(total), "LOCAL_WORLD_SIZE": str(local), "RANK": "0",
               "LOCAL_RANK": "0"}
        facts = machine(local, nvlink=18, env=env, links={(0, 1): 0} if odd_pair else None)
        policy = policy_of("torch", global_batch_size=8 * total, world_size=total,
                           local_world_size=local, user_env=tuple(sorted(env)))
        first = time.perf_counter()  # builds the link index (once per Facts value)
        plan(facts, rules, {}, policy)
        first_s = time.perf_counter() - first
        plan_s = _median_s(lambda f=facts, p=policy: plan(f, rules, {}, p), args.repeat)
        # a new Facts value each time (same facts, no index built yet): what a run pays
        decide_s = _median_s(
            lambda f=facts, g=8 * total: simulate(replace(f), framework="torch", global_batch_size=g),
            args.repeat)
        held = f"{len(facts.links)}" + (" + fabric" if getattr(facts, "fabric", None) else "")
        rows.append((total, nodes, held, first_s, plan_s, decide_s))

    print(f"source: {args.src}\n")
    print("| GPUs | nodes | links in facts | first plan() | plan() | whole simulated decision |")
    print("|-----:|------:|---------------:|-------------:|-------:|-------------------------:|")
    for total, nodes, links, first_s, plan_s, decide_s in rows:
        print(f"| {total} | {nodes} | {links} | {first_s * 1e3:.2f} ms | {plan_s * 1e3:.2f} ms "
              f"| {decide_s * 1e3:.1f} ms |")
    catalogue(Path(args.src).resolve().parent)


def catalogue(root: Path) -> None:
    """The field catalogue's row: decide every case, as ``plan --simulate`` does."""
    import json
    from collections import Counter

    from resilient_strategy.cli import simulate_file
    from resilient_strategy.core.knowledge.remedies import builtin_remedies
    from resilient_strategy.core.knowledge.signatures import builtin_signatures

    paths = sorted((root / "examples" / "machines" / "field").glob("*.json"))
    if not paths:
        return
    families: Counter[str] = Counter()
    probes, keep = [], 0
    t = time.perf_counter()
    for path in paths:
        data = json.loads(path.read_text(encoding="utf-8"))
        families[data.get("family", "?")] += 1
        sel = next(iter(simulate_file(path).values()))
        probes.append((len(sel.results), path.stem))
        keep += sel.backend in ("nccl", "mw_nccl") and \
            sel.num_replicas >= sel.plan.reference_replicas
    total_s = time.perf_counter() - t
    most = max(probes)
    causes = builtin_signatures().causes
    print(f"\nfield catalogue: {len(paths)} cases decided in {total_s * 1e3:.0f} ms "
          f"({total_s / len(paths) * 1e3:.1f} ms a case, no probe run); most probes: {most[0]} "
          f"({most[1]}); keep NCCL at full replica count: {keep}/{len(paths)} "
          f"({keep / len(paths):.0%}); signature table: {len(builtin_signatures().entries)} "
          f"entries over {len(causes)} causes; remedies: {len(builtin_remedies().remedies)}\n")
    print("| family | cases |\n|---|--:|")
    for family, n in sorted(families.items()):
        print(f"| {family} | {n} |")


if __name__ == "__main__":
    main()
