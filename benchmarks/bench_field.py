"""Every sourced field case through the testing kit: expected against decided, totals per kind,
the simulated seconds each decision spent, and what a wedged NVML costs the decision.

The cases are every machine description that carries a public ``source``: the catalogue
(``examples/machines/**``), the cases held out while issue 31's engine was built
(``tests/fixtures/field_heldout/``) and the ones it was built from
(``tests/fixtures/field_training/``). Each is decided exactly as
``resilient-strategy plan --simulate FILE`` decides it (`cli.simulate_file`), and judged
against its ``expect`` block as ``tests/test_machine_cases.py`` judges it (an ``xfail`` there is a
"NO" here). Its kind (``kind``, `testing.simulation.FIELD_KINDS`) groups the totals.

Simulated time: the seconds the kit's prober charged the decision (`probing.cost`: each probe
by how it ends, a hang by the prober's own stall policy, the deferred GPU health checks), against
the decision's probe budget (`Options.budget_s`). A silent hang's search must stay within it.

Wedged NVML: `machine.inspect.detect_facts` given a stand-in NVML whose every call blocks (as a
wedged driver's does), in a daemon thread this script waits on for at most ``--nvml-cap``
seconds; the stand-in is released afterwards, so nothing is left behind. Where
`machine/nvml.py` has a deadline, the row says how long the decision waited for it.

    PYTHONPATH=src python benchmarks/bench_field.py            # the table
    PYTHONPATH=src python benchmarks/bench_field.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SETS = {"catalogue": ROOT / "examples" / "machines",
        "heldout": ROOT / "tests" / "fixtures" / "field_heldout",
        "training": ROOT / "tests" / "fixtures" / "field_training"}


def _probe_name(key: str) -> str:
    parts = key.split(":", 3)
    return parts[1] + ("+" + parts[3].replace(";", ",") if len(parts) > 3 else "")


def _env_text(env: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(env.items()))


def expected_text(expect: dict[str, Any]) -> str:
    """The expect block in one short line: "nccl x8 NCCL_NVLS_ENABLE=0" or "error GpuUnusableError"."""
    if "error" in expect:
        return f"error {expect['error'].get('type', '?')}"
    parts = [str(expect.get("backend", "(any backend)"))]
    if "num_replicas" in expect:
        parts[0] += f" x{expect['num_replicas']}"
    if expect.get("env"):
        parts.append(_env_text(expect["env"]))
    elif "env" in expect:
        parts.append("(no env)")
    parts += [f"says {w!r}" for w in expect.get("explain_contains", ())]
    parts += [f"rule {r}" for r in expect.get("rules_fired", ())]
    return " ".join(parts)


def judge(path: Path) -> dict[str, Any]:
    """One case decided and judged: right, what was decided, what was wrong, simulated seconds."""
    from resilient_strategy.cli import simulate_file
    from resilient_strategy.errors import ResilientStrategyError
    from resilient_strategy.testing.simulation import SimulatedProber

    data = json.loads(path.read_text(encoding="utf-8"))
    expect: dict[str, Any] = data["expect"]
    probers: list[SimulatedProber] = []
    wrong: list[str] = []
    try:
        selections = simulate_file(path, probers=probers)
    except ResilientStrategyError as exc:
        got_error = {"type": type(exc).__name__,
                     "gpus": [i for i, _ in getattr(exc, "gpus", ())],
                     "probed": [_probe_name(k) for k in getattr(exc, "probed", ())],
                     "offload_would_fit": getattr(exc, "offload_would_fit", None),
                     "table_keys": sorted({row.key for row in getattr(exc, "table", ())})}
        want = expect.get("error")
        if want is None:
            wrong.append("error")
        else:
            wrong += [f"error.{k}" for k, v in want.items() if got_error.get(k) != v]
        decided = f"error {got_error['type']}" + (f" gpus={got_error['gpus']}"
                                                   if got_error["gpus"] else "")
        return {"right": not wrong, "decided": decided, "wrong": wrong,
                "sim_s": sum(p.clock() for p in probers), "health_s": None,
                "probes": len(got_error["probed"])}
    sel = selections[data["framework"]] if "framework" in data else next(iter(selections.values()))
    sim_s = sum(p.clock() for p in probers)
    # the GPU health checks: what the prober charged beyond the probes themselves
    health_s = max(0.0, sim_s - sum(r.elapsed_s for r in sel.results.values()))
    decided = f"{sel.backend} x{sel.num_replicas}" + (f" {_env_text(dict(sel.env))}"
                                                      if sel.env else "")
    if "error" in expect:
        return {"right": False, "decided": decided, "wrong": ["error"], "sim_s": sim_s,
                "health_s": health_s, "probes": len(sel.results)}
    got = {"backend": sel.backend, "devices": list(sel.devices), "num_replicas": sel.num_replicas,
           "accumulation_steps": sel.accumulation_steps, "env": dict(sel.env),
           "per_replica_batch_size": sel.per_replica_batch_size,
           "probed": [_probe_name(k) for k in sel.results],
           "sharded": sel.candidate.sharded, "offload": sel.candidate.offload,
           "ladder": [_probe_name(c.key) for c in sel.plan.candidates],
           "ruled_out_by_memory": [_probe_name(r.candidate.key) for r in sel.plan.ruled_out
                                   if r.rule == "memory"]}
    wrong += [k for k in expect if k in got and got[k] != expect[k]]
    causes = {_probe_name(k): r.cause for k, r in sel.results.items()}
    wrong += [f"causes.{k}" for k, v in expect.get("causes", {}).items() if causes.get(k) != v]
    wrong += [f"rule {r}" for r in expect.get("rules_fired", ()) if r not in sel.plan.rules_fired]
    text = sel.explain(verbose=True)  # the whole trace, as the machine-case test reads it
    wrong += [f"says {w!r}" for w in expect.get("explain_contains", ()) if w not in text]
    return {"right": not wrong, "decided": decided, "wrong": wrong, "sim_s": sim_s,
            "health_s": health_s, "probes": len(sel.results)}


def field_cases() -> list[tuple[str, Path]]:
    """(set, path) of every case file with a public source."""
    out = []
    for name, folder in SETS.items():
        for path in sorted(folder.rglob("*.json")):
            data = json.loads(path.read_text(encoding="utf-8"))
            if str(data.get("source", "")).strip():
                out.append((name, path))
    return out


class _BlockingNvml:
    """A stand-in pynvml whose every call blocks until released, as a wedged driver's does
    (nvidia-smi and every NVML/CUDA call hang)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if not name.startswith("nvml"):
            raise AttributeError(name)

        def call(*_args: Any) -> Any:
            self.entered.set()
            self.release.wait()
            raise RuntimeError(f"{name}: released by the benchmark")
        return call


def wedged_nvml(cap_s: float) -> dict[str, Any]:
    """Seconds `detect_facts` took with an NVML that blocks (None: still blocked at ``cap_s``)."""
    from resilient_strategy.machine import inspect as _inspect
    from resilient_strategy.machine import nvml as _nvml

    stand_in = _BlockingNvml()
    done: dict[str, Any] = {}

    def run() -> None:
        t0 = time.perf_counter()
        facts = _inspect.detect_facts({}, nvml=stand_in)
        done["s"] = time.perf_counter() - t0
        done["gpus"] = len(facts.gpus)
        done["nvml_error"] = facts.nvml_error

    t0 = time.perf_counter()
    worker = threading.Thread(target=run, name="bench-wedged-nvml", daemon=True)
    worker.start()
    worker.join(cap_s)
    waited = time.perf_counter() - t0
    blocked = worker.is_alive()
    stand_in.release.set()  # let the blocked call return: no thread is left behind
    worker.join(5.0)
    deadline = next((getattr(_nvml, n) for n in dir(_nvml)
                     if "DEADLINE" in n and isinstance(getattr(_nvml, n), (int, float))), None)
    return {"cap_s": cap_s, "blocked_at_cap": blocked, "entered_nvml": stand_in.entered.is_set(),
            "seconds": None if blocked else done.get("s"), "waited_s": round(waited, 3),
            "nvml_deadline_s": deadline, "gpus": done.get("gpus"),
            "nvml_error": None if blocked else done.get("nvml_error")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    parser.add_argument("--nvml-cap", type=float, default=30.0,
                        help="seconds to wait on the wedged-NVML inspection (default 30)")
    args = parser.parse_args(argv)
    import resilient_strategy
    from resilient_strategy.core.call.options import Options
    from resilient_strategy.testing.simulation import FIELD_KINDS

    budget_s = Options(framework="torch").budget_s
    rows = []
    for set_name, path in field_cases():
        data = json.loads(path.read_text(encoding="utf-8"))
        try:
            row = judge(path)
        except Exception as exc:  # a file this tree cannot read counts as not right
            row = {"right": False, "decided": f"unreadable: {type(exc).__name__}", "wrong": [],
                   "sim_s": 0.0, "health_s": None, "probes": 0}
        rows.append({"case": path.stem, "set": set_name, "kind": data.get("kind", "?"),
                     "expected": expected_text(data["expect"]), **row})
    kinds = {k: {"right": sum(r["right"] for r in rows if r["kind"] == k),
                 "total": sum(r["kind"] == k for r in rows),
                 "max_sim_s": max((r["sim_s"] for r in rows if r["kind"] == k), default=0.0)}
             for k in (*FIELD_KINDS, *sorted({r["kind"] for r in rows} - set(FIELD_KINDS)))}
    sets = {s: {"right": sum(r["right"] for r in rows if r["set"] == s),
                "total": sum(r["set"] == s for r in rows)} for s in SETS}
    hangs = [r for r in rows if r["kind"] == "silent_hang"]
    worst = max(hangs, key=lambda r: r["sim_s"]) if hangs else None
    report = {"package": resilient_strategy.__file__, "budget_s": budget_s,
              "right": sum(r["right"] for r in rows), "total": len(rows),
              "sets": sets, "kinds": kinds,
              "silent_hang_max_s": worst["sim_s"] if worst else None,
              "silent_hang_max_case": worst["case"] if worst else None,
              "over_budget": [r["case"] for r in rows if r["sim_s"] > budget_s],
              "wedged_nvml": wedged_nvml(args.nvml_cap), "cases": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"package: {report['package']}")
    per_set = ", ".join(f"{s} {v['right']}/{v['total']}" for s, v in sets.items())
    print(f"\n## {report['right']}/{report['total']} field cases right ({per_set})\n")
    print(f"{'':3} {'case':<38} {'set':<9} {'kind':<15} {'sim s':>6}  expected -> decided")
    for r in sorted(rows, key=lambda r: (list(kinds).index(r["kind"]), r["set"], r["case"])):
        mark = "ok " if r["right"] else "NO "
        wrong = f"  [wrong: {', '.join(r['wrong'])}]" if r["wrong"] else ""
        print(f"{mark} {r['case'][:38]:<38} {r['set']:<9} {r['kind']:<15} {r['sim_s']:>6.1f}  "
              f"{r['expected']} -> {r['decided']}{wrong}")
    print(f"\n## per kind (decision budget {budget_s:g} s)\n")
    print(f"{'kind':<18} {'right':>9} {'max sim s':>10}")
    for k, v in kinds.items():
        print(f"{k:<18} {v['right']:>4}/{v['total']:<4} {v['max_sim_s']:>10.1f}")
    if worst is not None:
        health = worst.get("health_s")
        split = "" if health is None else \
            f": probes {worst['sim_s'] - health:.1f} s, GPU health checks {health:.1f} s"
        print(f"\nslowest silent-hang search: {worst['case']} {worst['sim_s']:.1f} s of the "
              f"{budget_s:g} s budget ({worst['probes']} probes{split}); over budget: "
              f"{report['over_budget'] or 'none'}")
    w = report["wedged_nvml"]
    if w["blocked_at_cap"]:
        print(f"wedged NVML: the inspection was still blocked after {w['cap_s']:g} s (no "
              f"deadline on NVML in this tree: the decision would wait forever)")
    else:
        print(f"wedged NVML: the inspection returned after {w['seconds']:.2f} s (NVML deadline "
              f"{w['nvml_deadline_s']}), {w['gpus']} GPUs, nvml_error: {w['nvml_error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
