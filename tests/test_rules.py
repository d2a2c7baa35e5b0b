"""Known-issue rules: the language, the built-in file, user rules."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.version import Version

from resilient_strategy.errors import InvalidRuleError
from resilient_strategy.rules import (
    clause_holds,
    fact_values,
    fired,
    load_rules,
    parse_clause,
    parse_rules,
    rule_from_dict,
)
from resilient_strategy.testing import machine

RULES = load_rules()


def ids(facts, framework: str) -> set[str]:  # type: ignore[no-untyped-def]
    return {r.id for r in fired(RULES, facts, framework)}


def test_every_builtin_rule_has_a_source_and_message() -> None:
    assert len(RULES) >= 15
    for r in RULES:
        assert r.source and r.message and r.id
        assert r.effect in ("veto", "prefer", "remedy", "set_env", "warn")


@pytest.mark.parametrize(
    ("text", "fact", "op", "value", "neg"),
    [
        ("tensorflow.version < 2.20", "tensorflow.version", "<", "2.20", False),
        ("gpus.names matches RTX 50", "gpus.names", "matches", "RTX 50", False),
        ("not host.wsl2", "host.wsl2", "truthy", "", True),
        ("env.NCCL_TIMEOUT != ''", "env.NCCL_TIMEOUT", "!=", "", False),
        ("host.iommu in [on, unknown]", "host.iommu", "in", "[on, unknown]", False),
    ],
)
def test_parse_clause(text: str, fact: str, op: str, value: str, neg: bool) -> None:
    c = parse_clause(text)
    assert (c.fact, c.op, c.value, c.negate) == (fact, op, value, neg)


@pytest.mark.parametrize("bad", ["tensorflow.version <", "gpus.count 3", "just words here", "x <= "])
def test_bad_clauses_are_typed_errors(bad: str) -> None:
    with pytest.raises(InvalidRuleError):
        parse_clause(bad)


def test_clause_semantics_versions_numbers_unknowns() -> None:
    facts = machine(2, tensorflow="2.15.1", tf_cuda="12.2", torch=None)
    v = fact_values(facts, "tensorflow")
    assert v["tensorflow.version"] == Version("2.15.1")
    assert clause_holds(parse_clause("tensorflow.version < 2.20"), v)
    assert not clause_holds(parse_clause("tensorflow.version >= 2.20"), v)
    assert clause_holds(parse_clause("gpus.count >= 2"), v)
    # torch is not installed: clauses on its version never hold, negated or not
    assert not clause_holds(parse_clause("torch.version < 3"), v)
    assert not clause_holds(parse_clause("not torch.version"), v)
    # an unset variable reads as empty
    assert not clause_holds(parse_clause("env.NCCL_TIMEOUT != ''"), v)
    assert clause_holds(parse_clause("gpus.names matches h200"), v)


def test_seed000_rtx5090_tf215_vetoes_tf_nccl() -> None:
    facts = machine(2, name="NVIDIA GeForce RTX 5090", cc=(12, 0), tensorflow="2.15.1",
                    tf_cuda="12.2", tf_archs=("sm_70", "compute_80"), torch=None)
    assert {"tf-nccl-before-blackwell", "tf-ptx-jit-only", "consumer-pcie-p2p"} <= ids(facts, "tensorflow")


def test_blackwell_torch_rules_follow_nccl_version() -> None:
    old = machine(2, name="NVIDIA GeForce RTX 5090", cc=(12, 0), torch_nccl="2.21.5")
    new = machine(2, name="NVIDIA GeForce RTX 5090", cc=(12, 0), torch_nccl="2.26.2")
    assert {"torch-nccl-before-blackwell", "nccl-sm120-needs-2.26.2"} <= ids(old, "torch")
    assert not {"torch-nccl-before-blackwell", "nccl-sm120-needs-2.26.2"} & ids(new, "torch")


def test_host_rules() -> None:
    assert "small-dev-shm" in ids(machine(2, shm_mb=64), "torch")
    assert "small-dev-shm" not in ids(machine(2, shm_mb=65536), "torch")
    assert "small-dev-shm" not in ids(machine(2, shm_mb=None), "torch")  # unknown: no guess
    assert "wsl2-single-gpu-nccl" in ids(machine(2, wsl2=True), "torch")
    assert "aws-ofi-without-efa" in ids(machine(2, aws=True), "torch")
    assert "aws-ofi-without-efa" not in ids(machine(2, aws=True, efa=True), "torch")
    assert "iommu-p2p" in ids(machine(2, iommu="on"), "torch")
    assert "iommu-p2p" not in ids(machine(2, iommu="on", nvlink=12), "torch")
    assert "nccl-timeout-is-not-a-variable" in ids(machine(2, env={"NCCL_TIMEOUT": "1800"}), "torch")


def test_kernel_coverage_fact() -> None:
    jit = machine(1, cc=(12, 0), tensorflow="2.17.0", tf_cuda="12.3", tf_archs=("sm_89", "compute_90"))
    native = machine(1, cc=(8, 6), tensorflow="2.17.0", tf_cuda="12.3", tf_archs=("sm_80", "compute_90"))
    none = machine(1, cc=(12, 0), torch_archs=("sm_80", "sm_90"))
    assert fact_values(jit, "tensorflow")["tensorflow.gpu_kernels"] == "ptx_jit"
    assert fact_values(native, "tensorflow")["tensorflow.gpu_kernels"] == "native"
    assert fact_values(none, "torch")["torch.gpu_kernels"] == "none"
    assert "torch-no-kernels-for-gpu" in ids(none, "torch")


def test_framework_scoped_rules_do_not_fire_for_the_other_framework() -> None:
    facts = machine(2, name="NVIDIA GeForce RTX 5090", cc=(12, 0), tensorflow="2.15.1", tf_cuda="12.2")
    assert "tf-nccl-before-blackwell" not in ids(facts, "torch")


def test_user_rules_add_replace_and_disable(tmp_path: Path) -> None:
    f = tmp_path / "mine.toml"
    f.write_text(
        '[[rule]]\nid = "lab-a100-box"\nwhen = ["gpus.names matches A100"]\neffect = "veto"\n'
        'target = "nccl"\nmessage = "our A100 box has a bad NVSwitch"\nsource = "ticket 42"\n'
        '[[rule]]\nid = "small-dev-shm"\nwhen = ["host.shm_mb < 1"]\neffect = "warn"\n'
        'message = "replaced"\nsource = "us"\n'
    )
    rules = load_rules([f], disabled=["wsl2-single-gpu-nccl"])
    by_id = {r.id: r for r in rules}
    assert by_id["lab-a100-box"].origin == str(f)
    assert by_id["small-dev-shm"].message == "replaced"
    assert "wsl2-single-gpu-nccl" not in by_id
    a100 = machine(2, name="NVIDIA A100-SXM4-80GB", cc=(8, 0))
    assert "lab-a100-box" in {r.id for r in fired(rules, a100, "torch")}


@pytest.mark.parametrize(
    ("rule", "problem"),
    [
        ({"id": "x", "effect": "explode", "message": "m", "source": "s"}, "effect must be"),
        ({"id": "x", "effect": "veto", "target": "mpi", "message": "m", "source": "s"}, "target"),
        ({"id": "x", "effect": "remedy", "message": "m", "source": "s"}, "needs env"),
        ({"id": "x", "effect": "warn", "message": "m"}, "source"),
        ({"id": "x", "effect": "warn", "message": "m", "source": "s", "colour": 1}, "unknown key"),
        ({"effect": "warn"}, "needs an id"),
    ],
)
def test_malformed_rules_are_typed_errors(rule: dict, problem: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidRuleError, match=problem):
        rule_from_dict(rule)


def test_bad_toml_and_duplicate_ids() -> None:
    with pytest.raises(InvalidRuleError, match="not valid TOML"):
        parse_rules("[[rule]\n", "f.toml")
    dup = '[[rule]]\nid="a"\neffect="warn"\nmessage="m"\nsource="s"\n' * 2
    with pytest.raises(InvalidRuleError, match="duplicate"):
        parse_rules(dup, "f.toml")
    with pytest.raises(InvalidRuleError, match="cannot read"):
        load_rules(["/nonexistent/rules.toml"])
