"""Every described machine in examples/machines carries the decision it must reach (``expect``),
and this one test replays them all, as ``resilient-strategy plan --simulate FILE`` does: data
in, expected decision out. A new failure case is one JSON file, no Python.

``XFAIL`` is the explicit list of cases that do not reach their expected decision yet, each with
the reason (strict: a case that starts passing must leave the list)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from resilient_strategy.cli import simulate_file
from resilient_strategy.errors import ResilientStrategyError
from resilient_strategy.testing.simulation import EXPECT_KEYS, FIELD_KINDS

MACHINES = Path(__file__).parents[1] / "examples" / "machines"
#: The field catalogue: cases copied from public reports, each with its source and family.
FIELD = MACHINES / "field"
FAMILIES = frozenset({
    "nvswitch", "pcie_p2p", "consumer_gpu", "vm", "container_shm", "rdma", "sockets",
    "multi_node", "windows_wsl", "versions", "user_variables", "tensorflow", "mid_run",
})
#: Issue 31's field sets (public threads): held out while the engine was built, and the ones it
#: was built from; benchmarks/bench_field_heldout.py prints their table before/after.
FIXTURES = Path(__file__).parent / "fixtures"
FIELD_SETS = (FIXTURES / "field_heldout", FIXTURES / "field_training",
              # issue 45.7's held-out reports of kinds named in no earlier issue
              FIXTURES / "field_heldout2")
#: case file (relative to examples/machines, or to tests/fixtures for the field sets) -> why it
#: does not reach its expected decision yet
XFAIL: dict[str, str] = {
    "field/docker_rtx3090_driver525_cuda121_804.json": "one GPU: the single-device candidate "
    "is never probed, and driver-older-than-cuda-build only warns: driver CUDA 12.0 against a "
    "12.1 build is within one major version (minor-version compatibility usually runs it); "
    "the 804 comes from the image's forward-compatibility libraries on a GeForce card "
    "(host.cuda_compat reads them now, but the thread does not say which the image carries)",
    "field_heldout/driver560_p2p_hang.json": "no sourced rule names the driver 560 P2P hang "
    "(searched again for issue 31: the only public source is this held-out thread, xgboost#11242)",
    "field_heldout/h100nvl_x3_lo_fixes_hang.json": "no fact of the machine points a hang at "
    "the socket interface here (the hostname is not on loopback); loopback tried on every "
    "one-node hang (tried for issue 31, with nccl#352 as a second source) reorders two "
    "catalogue cases and lengthens every one-node hang ladder by a hung probe",
    "field_heldout/ib_three_nics_pods_hang.json": "the HCA that is on another fabric is not "
    "a fact (every port reads active): the search ends on IB off, which runs",
    "field_heldout2/vgpu_uvm_off_operation_not_supported.json": "NCCL fails on every variant "
    "and gloo would run on both vGPUs, but the planner's estimate ranks one GPU above gloo on "
    "two without probing gloo (the thread names no gloo run either; the expected gloo is the "
    "case author's reading, issue 45.7)",
    "field_training/nvls_alltoall_init_hang_16x8.json": "a set-up hang across nodes tries the "
    "network first and NVLS not at all (nccl#913: the bootstrap interface, far more often)",
}


def _probe_name(key: str) -> str:
    """A candidate key as a probe-outcome key of the case file: "nccl", "nccl+NCCL_P2P_DISABLE=1"."""
    parts = key.split(":", 3)
    return parts[1] + ("+" + parts[3].replace(";", ",") if len(parts) > 3 else "")


def _name(p: Path) -> str:
    return (p.relative_to(FIXTURES) if p.is_relative_to(FIXTURES)
            else p.relative_to(MACHINES)).as_posix()


def _files() -> list[Path]:
    return [*sorted(MACHINES.rglob("*.json")), *(p for d in FIELD_SETS
                                                for p in sorted(d.glob("*.json")))]


def _cases() -> list[Any]:
    return [
        pytest.param(p, id=_name(p).removesuffix(".json"),
                     marks=[pytest.mark.xfail(strict=True, reason=XFAIL[_name(p)])]
                     if _name(p) in XFAIL else [])
        for p in _files()
    ]


@pytest.mark.parametrize("path", _cases())
def test_machine_case_reaches_its_expected_decision(path: Path) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    expect = data.get("expect")
    assert isinstance(expect, dict) and expect, f"{path.name} has no expect block"
    assert set(expect) <= EXPECT_KEYS
    if "error" in expect:  # no decision: the typed error it ends in, and its fields
        with pytest.raises(ResilientStrategyError) as err:
            simulate_file(path)
        want = dict(expect["error"])
        assert type(err.value).__name__ == want.pop("type")
        table = getattr(err.value, "table", ())
        got_error = {"offload_would_fit": getattr(err.value, "offload_would_fit", None),
                     "table_keys": sorted({row.key for row in table}),
                     "gpus": [i for i, _ in getattr(err.value, "gpus", ())],
                     "probed": [_probe_name(k) for k in getattr(err.value, "probed", ())]}
        assert {k: got_error[k] for k in want} == want
        return
    selections = simulate_file(path)
    sel = selections[data["framework"]] if "framework" in data else next(iter(selections.values()))
    got = {
        "backend": sel.backend, "devices": list(sel.devices), "num_replicas": sel.num_replicas,
        "accumulation_steps": sel.accumulation_steps,
        "per_replica_batch_size": sel.per_replica_batch_size, "env": dict(sel.env),
        "probed": [_probe_name(k) for k in sel.results],
        "sharded": sel.candidate.sharded,
        "offload": sel.candidate.offload,
        "ladder": [_probe_name(c.key) for c in sel.plan.candidates],
        "ruled_out_by_memory": [_probe_name(r.candidate.key) for r in sel.plan.ruled_out
                                if r.rule == "memory"],
        "findings": [e.finding.id for e in sel.plan.events if e.kind == "nodes_differ"],
    }
    assert {k: got[k] for k in expect if k in got} == {k: expect[k] for k in expect if k in got}
    causes = {_probe_name(k): r.cause for k, r in sel.results.items()}
    assert {k: causes.get(k) for k in expect.get("causes", {})} == expect.get("causes", {})
    missing_rules = set(expect.get("rules_fired", ())) - set(sel.plan.rules_fired)
    assert not missing_rules, f"rules that did not fire: {sorted(missing_rules)}"
    noted = {e.topic for e in sel.plan.events if e.kind == "note"}
    assert sorted(set(expect.get("notes", ())) - noted) == []
    text = sel.explain(verbose=True)  # the whole trace
    assert [w for w in expect.get("explain_contains", ()) if w not in text] == []


def test_every_case_is_replayed() -> None:
    assert len(_cases()) == len(_files()) >= 6 + 16 + 8
    assert set(XFAIL) <= {_name(p) for p in _files()}


def test_every_field_case_is_sourced_and_in_a_family() -> None:
    cases = [json.loads(p.read_text(encoding="utf-8")) for p in
             [*sorted(FIELD.glob("*.json")), *(q for d in FIELD_SETS for q in d.glob("*.json"))]]
    assert len(cases) >= 40
    assert [c.get("family") for c in cases if c.get("family") not in FAMILIES] == []
    assert [c.get("what") for c in cases if not str(c.get("source", "")).strip()] == []
    assert len({c["family"] for c in cases}) >= 10
    assert [c.get("what") for c in cases if c.get("kind") not in FIELD_KINDS] == []


def test_a_field_case_of_an_unknown_kind_is_one_clean_error(tmp_path: Path) -> None:
    from resilient_strategy.testing.simulation import load_simulation

    data = json.loads((FIELD / "four_gpus_freeze_p2p_off.json").read_text(encoding="utf-8"))
    bad = tmp_path / "case.json"
    bad.write_text(json.dumps({**data, "kind": "hang"}), encoding="utf-8")
    with pytest.raises(ResilientStrategyError):  # the same file with a known kind loads
        load_simulation(bad)
    assert load_simulation(FIELD / "four_gpus_freeze_p2p_off.json")[1]["kind"] in FIELD_KINDS


#: Issue 41's described healthy machines (NVLink, NVSwitch, PCIe consumer and data-centre
#: cards; torch and TensorFlow; transformer, convolutional and MLP models of several sizes).
HEALTHY = MACHINES / "healthy"


@pytest.mark.parametrize("path", sorted(HEALTHY.glob("*.json")), ids=lambda p: p.stem)
@pytest.mark.parametrize("model", [True, False], ids=["model", "no_model"])
def test_a_healthy_machine_trains_on_every_gpu(path: Path, model: bool, tmp_path: Path) -> None:
    """No proven GPU is left idle on an estimate: with the model's size (gradient_bytes=, as
    model= gives it) and without, every GPU trains, and the trace says the ranking is
    provisional (nothing measured the compute)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not model:
        data = {k: v for k, v in data.items() if k not in ("gradient_bytes", "param_bytes")}
    case = tmp_path / path.name
    case.write_text(json.dumps(data), encoding="utf-8")
    (sel,) = simulate_file(case).values()
    gpus = data["machine"]["gpus"]
    assert (sel.num_replicas, list(sel.devices)) == (gpus, list(range(gpus)))
    assert sel.accumulation_steps == 1
    kept = [e.kept for e in sel.plan.events if e.kind == "ranking_provisional"]
    assert kept == [tuple(range(gpus))]


def test_the_healthy_machines_cover_both_frameworks_and_every_kind_of_link() -> None:
    cases = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(HEALTHY.glob("*.json"))]
    assert {c["framework"] for c in cases} == {"torch", "tensorflow"}
    machines = [c["machine"] for c in cases]
    assert any(m.get("platform_facts", {}).get("nvswitch") for m in machines)  # NVSwitch
    assert any(m.get("nvlink") and not m.get("platform_facts") for m in machines)  # NVLink pair
    assert any("GeForce" in m["name"] for m in machines)  # PCIe consumer cards
    assert any(not m.get("nvlink") and "GeForce" not in m["name"] for m in machines)
    assert len({c["gradient_bytes"] for c in cases}) >= 5  # model sizes
