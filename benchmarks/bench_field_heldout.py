"""Field cases replayed through the testing kit: expected against decided, per case and in total.

Each case file (``tests/fixtures/field_heldout/*.json``: public threads held out while the engine
was built; ``tests/fixtures/field_training/*.json``: threads it may be built from) describes the
machine a thread reports, what each candidate did there, and the decision that thread supports
(``expect``, the schema of ``examples/machines``). This script decides each one exactly as
``resilient-strategy plan --simulate FILE`` does and prints a table and the totals.

Before/after: run it once against the code before a change and once after, e.g.::

    git worktree add /tmp/base <commit>
    PYTHONPATH=/tmp/base/src python benchmarks/bench_field_heldout.py   # before
    PYTHONPATH=src python benchmarks/bench_field_heldout.py             # after

A case whose file the older kit cannot read (a field it lacks) counts as not right.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SETS = {"heldout": ROOT / "tests" / "fixtures" / "field_heldout",
        "training": ROOT / "tests" / "fixtures" / "field_training",
        # issue 45.7: reports of kinds named in no earlier issue, written before any change
        "heldout2": ROOT / "tests" / "fixtures" / "field_heldout2"}


def _probe_name(key: str) -> str:
    parts = key.split(":", 3)
    return parts[1] + ("+" + parts[3].replace(";", ",") if len(parts) > 3 else "")


def judge(path: Path) -> tuple[bool, str]:
    """(right, what was decided) for one case file."""
    from resilient_strategy.cli import simulate_file
    from resilient_strategy.errors import ResilientStrategyError

    data = json.loads(path.read_text(encoding="utf-8"))
    expect: dict[str, Any] = data["expect"]
    try:
        selections = simulate_file(path)
    except ResilientStrategyError as exc:
        got_error = {"type": type(exc).__name__,
                     "gpus": [i for i, _ in getattr(exc, "gpus", ())],
                     "probed": [_probe_name(k) for k in getattr(exc, "probed", ())]}
        want = expect.get("error")
        if want is None:
            return False, f"error {type(exc).__name__}: {str(exc).splitlines()[0][:70]}"
        ok = all(got_error.get(k) == v for k, v in want.items())
        return ok, f"error {got_error['type']} gpus={got_error['gpus']} probed={got_error['probed']}"
    if "error" in expect:
        sel = next(iter(selections.values()))
        return False, f"{sel.backend} x{sel.num_replicas} (expected {expect['error']['type']})"
    sel = selections[data["framework"]] if "framework" in data else next(iter(selections.values()))
    got = {"backend": sel.backend, "devices": list(sel.devices), "num_replicas": sel.num_replicas,
           "accumulation_steps": sel.accumulation_steps, "env": dict(sel.env),
           "per_replica_batch_size": sel.per_replica_batch_size,
           "probed": [_probe_name(k) for k in sel.results]}
    wrong = [k for k in expect if k in got and got[k] != expect[k]]
    causes = {_probe_name(k): r.cause for k, r in sel.results.items()}
    wrong += [f"causes.{k}" for k, v in expect.get("causes", {}).items() if causes.get(k) != v]
    wrong += [f"rule {r}" for r in expect.get("rules_fired", ()) if r not in sel.plan.rules_fired]
    # the whole trace, as tests/test_machine_cases.py reads it (explain() alone fits a screen)
    text = sel.explain(verbose=True) if "verbose" in sel.explain.__code__.co_varnames \
        else sel.explain()
    wrong += [f"says {w!r}" for w in expect.get("explain_contains", ()) if w not in text]
    env = ",".join(f"{k}={v}" for k, v in sorted(sel.env.items()))
    decided = f"{sel.backend} x{sel.num_replicas}" + (f" {env}" if env else "") + \
        f" ({len(sel.results)} probes)"
    return not wrong, decided + ("" if not wrong else f"; wrong: {', '.join(wrong)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=[*SETS, "all"], default="all")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args(argv)
    import resilient_strategy

    names = list(SETS) if args.set == "all" else [args.set]
    report: dict[str, Any] = {"package": resilient_strategy.__file__, "sets": {}}
    for name in names:
        rows = []
        for path in sorted(SETS[name].glob("*.json")):
            try:
                ok, decided = judge(path)
            except Exception as exc:
                ok, decided = False, f"unreadable here: {type(exc).__name__}: {exc}"[:110]
            family = json.loads(path.read_text(encoding="utf-8")).get("family", "")
            rows.append({"case": path.stem, "family": family, "right": ok, "decided": decided})
        report["sets"][name] = {"right": sum(r["right"] for r in rows), "total": len(rows),
                                "cases": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"package: {report['package']}")
    for name, s in report["sets"].items():
        print(f"\n## {name}: {s['right']}/{s['total']} right")
        for r in s["cases"]:
            mark = "ok " if r["right"] else "NO "
            print(f"{mark} {r['case']:<34} {r['family']:<15} {r['decided']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
