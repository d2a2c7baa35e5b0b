"""The variables a candidate may set (`core/knowledge/candidate_env`): every variable a shipped
remedy, rule or candidate sets is allowed; the loader's, the interpreter's, a plugin's or a
file's never are, whether a probe spec comes from the job's store or is applied by the prober."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from resilient_strategy.cli import simulate_file
from resilient_strategy.core.knowledge.candidate_env import refusal, refused
from resilient_strategy.core.knowledge.remedies import builtin_remedies
from resilient_strategy.core.knowledge.rules import load_rules, parse_rules
from resilient_strategy.core.measures.probe import ProbeSpec
from resilient_strategy.errors import InvalidRuleError, MultiNodeError, ResilientStrategyError
from resilient_strategy.nodes.messages import Round
from resilient_strategy.nodes.routes import remedy_rules
from resilient_strategy.probing.prober import PACKAGE_ROOT, worker_env
from resilient_strategy.testing.simulation import SimulatedProber

ROOT = Path(__file__).resolve().parent.parent
MACHINES = ROOT / "examples" / "machines"
FIELD = [ROOT / "tests" / "fixtures" / "field_heldout", ROOT / "tests" / "fixtures" / "field_training"]

#: What a forged probe spec tried, or could try: each runs or writes what it names.
HOSTILE = ["LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "PYTHONPATH", "PYTHONSTARTUP",
           "PYTHONHOME", "PATH", "BASH_ENV", "ENV", "HOME", "TMPDIR", "NCCL_NET_PLUGIN",
           "NCCL_TUNER_PLUGIN", "NCCL_PROFILER_PLUGIN", "NCCL_CONF_FILE", "NCCL_DEBUG_FILE",
           "NCCL_TOPO_FILE", "NCCL_GRAPH_DUMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
           "CUDA_INJECTION64_PATH", "TF_CONFIG", "TF_XLA_FLAGS", "lower_case", "A B", ""]


@pytest.mark.parametrize("name", HOSTILE)
def test_no_candidate_sets_the_loader_the_interpreter_a_plugin_or_a_file(name: str) -> None:
    assert refusal(name, "/tmp/x.so") != ""


def test_a_value_with_a_control_character_or_too_long_is_refused() -> None:
    assert refusal("NCCL_SOCKET_IFNAME", "eth0") == ""
    assert refusal("NCCL_SOCKET_IFNAME", "eth0\nLD_PRELOAD=/x") != ""
    assert refusal("NCCL_SOCKET_IFNAME", "e" * 5000) != ""


def _shipped_pairs() -> list[tuple[str, str, str]]:
    """(where, name, value) of every variable a shipped rule, remedy or remedy between nodes
    sets."""
    out = [(f"rule {r.id}", k, v) for r in load_rules() for k, v in r.env]
    out += [(f"remedy {r.id}", k, v) for r in builtin_remedies().remedies for k, v in r.env]
    out += [(f"multinode {r.id}", k, v) for r in remedy_rules() for k, v in r.env]
    return out


def test_every_variable_a_shipped_rule_or_remedy_sets_is_allowed() -> None:
    pairs = _shipped_pairs()
    assert len(pairs) >= 20  # the tables were read
    # a value filled in from the facts ("={platform.rdma_devices}") or resolved per node
    # ("@route") is checked as the template it is, and again where it is applied
    assert [(w, k) for w, k, v in pairs if refusal(k, v)] == []


def _case_files() -> list[Path]:
    return [*sorted(MACHINES.rglob("*.json")), *(p for d in FIELD for p in sorted(d.glob("*.json")))]


def test_every_variable_a_candidate_of_the_machine_cases_sets_is_allowed() -> None:
    """Every machine case the planner is tested on, decided as ``plan --simulate`` does: the
    variables of every candidate planned, probed and chosen."""
    seen: list[tuple[str, str, str]] = []
    files = _case_files()
    assert len(files) >= 30
    for path in files:
        probers: list[SimulatedProber] = []
        try:
            selections = simulate_file(path, probers=probers)
        except ResilientStrategyError:
            selections = {}
        for pr in probers:
            seen += [(path.name, k, v) for spec in pr.calls for k, v in spec.env]
        for sel in selections.values():
            seen += [(path.name, k, v) for c in sel.plan.candidates for k, v in c.env]
            seen += [(path.name, k, v) for k, v in dict(sel.env).items()]
    assert len({k for _, k, _ in seen}) >= 5  # NCCL_P2P_DISABLE, NCCL_SHM_DISABLE, ...
    assert [(f, k) for f, k, v in seen if refusal(k, v)] == []


def test_a_user_rule_that_sets_a_variable_no_candidate_may_is_refused_at_load() -> None:
    text = ("version = 1\n[[rule]]\nid = 'mine'\neffect = 'set_env'\nmessage = 'm'\n"
            "source = 's'\nenv = { LD_PRELOAD = '/tmp/x.so' }\n")
    with pytest.raises(InvalidRuleError):
        parse_rules(text, "mine.toml")


def test_the_prober_never_applies_a_variable_no_candidate_may_set(
        caplog: pytest.LogCaptureFixture) -> None:
    """Defence in depth: a spec that reached the prober with the loader's variables (from the
    store, or any other way) gets none of them into its workers' environment."""
    spec = ProbeSpec("torch:nccl:0,1", "torch", "nccl", (0, 1), world_size=2,
                     env=(("LD_PRELOAD", "/tmp/evil.so"), ("PYTHONPATH", "/tmp/evil"),
                          ("NCCL_NET_PLUGIN", "/tmp/evil.so"), ("NCCL_P2P_DISABLE", "1")))
    with caplog.at_level(logging.WARNING, "resilient_strategy"):
        env = worker_env(spec, {"PATH": "/usr/bin"})
    assert "LD_PRELOAD" not in env and "NCCL_NET_PLUGIN" not in env
    assert env["PYTHONPATH"] == PACKAGE_ROOT and env["NCCL_P2P_DISABLE"] == "1"
    assert sorted(getattr(r, "refused_variable", "") for r in caplog.records
                  if hasattr(r, "refused_variable")) == [
        "LD_PRELOAD", "NCCL_NET_PLUGIN", "PYTHONPATH"]


def test_a_probe_from_the_store_with_a_variable_no_candidate_may_set_is_refused() -> None:
    msg = {"kind": "probe", "spec": {
        "candidate": "torch:gloo:cpu", "framework": "torch", "backend": "gloo", "devices": [],
        "env": [["LD_PRELOAD", "/tmp/evil.so"]], "world_size": 2, "timeout_s": 10.0,
        "message_bytes": 1024, "train_step": True}}
    with pytest.raises(MultiNodeError):
        Round.from_json(json.loads(json.dumps(msg)))
    msg["spec"]["env"] = [["GLOO_SOCKET_IFNAME", "lo"]]
    assert Round.from_json(msg).spec is not None
    assert refused((("GLOO_SOCKET_IFNAME", "lo"), ("PATH", "/x"))) == [
        ("PATH", refusal("PATH", "/x"))]
