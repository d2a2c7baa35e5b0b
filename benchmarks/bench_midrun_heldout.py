"""Mid-run field cases replayed through the testing kit: expected against judged, per case and in
total (issue 45.7).

Each case file (``tests/fixtures/midrun_heldout/*.json``: public threads about a fault that
came in the middle of a training run, held out while the engine was changed) describes the
machine, the faults of its ranks (`resilient_strategy.testing.replay.MidRunFault`'s fields,
JSON: a ``chain`` is a list of lists of class names) and what the thread supports a correct
supervisor doing (``expect``). The job is replayed exactly as
`resilient_strategy.testing.replay.replay` replays one (the supervisor's classifier,
``run/verdicts.classify_attempt``, and its ladder, ``run/policy.relaunch``).

``expect`` fields (each optional, every one given must hold):

- ``verdict``: the first attempt's verdict kind (``backend``, ``exit``, ``stall``, ``user``...);
- ``cause``: the first attempt's verdict cause (a key of ``core/knowledge/causes.py``);
- ``actions``: every attempt's action, in order (``retry``, ``step_down``, ``stop``, ``finish``);
- ``exit_code``: what ``resilient-strategy run`` would exit with;
- ``backends``: every attempt's backend, in order;
- ``line_contains``: words the first failed attempt's one line (``fault_line``) must hold.

A case whose file the kit cannot read (a field it lacks) counts as not right. Before/after::

    git worktree add /tmp/base <commit>
    PYTHONPATH=/tmp/base/src python benchmarks/bench_midrun_heldout.py   # before
    PYTHONPATH=src python benchmarks/bench_midrun_heldout.py             # after
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SETS = {"midrun_heldout": ROOT / "tests" / "fixtures" / "midrun_heldout"}
#: Fields of a mid-run case file.
CASE_KEYS = frozenset({"what", "source", "family", "kind", "reported", "framework", "machine",
                       "faults", "steps", "checkpoint_every", "global_batch_size", "nproc",
                       "policy", "probes", "expect", "known_miss"})
EXPECT_KEYS = frozenset({"verdict", "cause", "actions", "exit_code", "backends",
                         "line_contains"})


def _fault(d: dict[str, Any]) -> Any:
    from resilient_strategy.testing.replay import MidRunFault

    kw = dict(d)
    if "chain" in kw:
        kw["chain"] = tuple(tuple(t) for t in kw["chain"])
    return MidRunFault(**kw)


def _facts(m: dict[str, Any]) -> Any:
    from resilient_strategy.testing.simulation import DescribedMachine

    return DescribedMachine.from_mapping(m).facts()


def run_case(path: Path) -> Any:
    """The replayed job of one case file."""
    from resilient_strategy.run.policy import RelaunchPolicy
    from resilient_strategy.testing.replay import replay

    data = json.loads(path.read_text(encoding="utf-8"))
    unknown = set(data) - CASE_KEYS
    if unknown or not set(data.get("expect", {})) <= EXPECT_KEYS:
        raise ValueError(f"{path.name}: unknown fields {sorted(unknown)}")
    kw: dict[str, Any] = {k: data[k] for k in ("steps", "checkpoint_every", "global_batch_size",
                                                "nproc", "probes") if k in data}
    if "policy" in data:
        kw["policy"] = RelaunchPolicy(**data["policy"])
    return replay(_facts(data["machine"]), [_fault(f) for f in data["faults"]],
                  framework=data.get("framework", "torch"), **kw)


def judge(path: Path) -> tuple[bool, str]:
    """(right, what was judged) for one case file."""
    from resilient_strategy.run.verdicts import fault_line

    data = json.loads(path.read_text(encoding="utf-8"))
    expect: dict[str, Any] = data["expect"]
    job = run_case(path)
    first = job.attempts[0]
    failed = next((a for a in job.attempts if not a.verdict.ok), None)
    line = "" if failed is None else fault_line(
        failed.number, job.candidates[failed.number].backend, failed.verdict, "EVIDENCE")
    got = {"verdict": first.verdict.kind.value, "cause": first.verdict.cause,
           "actions": job.actions, "exit_code": int(job.exit_code), "backends": job.backends}
    wrong = [k for k in expect if k in got and got[k] != expect[k]]
    wrong += [f"line lacks {w!r}" for w in expect.get("line_contains", ()) if w not in line]
    judged = (f"{got['verdict']}({got['cause'] or '-'}) {'>'.join(job.actions)} "
              f"exit {got['exit_code']}")
    return not wrong, judged + ("" if not wrong else f"; wrong: {', '.join(wrong)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    parser.add_argument("--lines", action="store_true", help="print each case's fault line too")
    args = parser.parse_args(argv)
    import resilient_strategy

    report: dict[str, Any] = {"package": resilient_strategy.__file__, "sets": {}}
    for name, folder in SETS.items():
        rows = []
        for path in sorted(folder.glob("*.json")):
            try:
                ok, judged = judge(path)
            except Exception as exc:
                ok, judged = False, f"unreadable here: {type(exc).__name__}: {exc}"[:110]
            data = json.loads(path.read_text(encoding="utf-8"))
            rows.append({"case": path.stem, "kind": data.get("kind", ""), "right": ok,
                         "judged": judged})
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
            print(f"{mark} {r['case']:<40} {r['kind']:<16} {r['judged']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
