"""Known-issue rules: the language, the built-in file, user rules."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from resilient_strategy.core.knowledge.clauses import (
    FACT_NAMES,
    clause_holds,
    fact_values,
    parse_clause,
)
from resilient_strategy.core.knowledge.rules import fired, load_rules, parse_rules, rule_from_dict
from resilient_strategy.errors import InvalidOptionError, InvalidRuleError
from resilient_strategy.testing import machine, simulate

RULES = load_rules()


def ids(facts, framework: str) -> set[str]:  # type: ignore[no-untyped-def]
    return {r.id for r in fired(RULES, facts, framework)}


def test_every_builtin_rule_has_a_source_and_message() -> None:
    assert len(RULES) >= 15
    for r in RULES:
        assert r.source and r.message and r.id
        assert r.effect in ("veto", "prefer", "remedy", "set_env", "warn", "no_gpu")
        # users read these: public sources only, never our internal report numbers
        assert not re.search(r"\bseeds?\b", f"{r.message} {r.source}", re.IGNORECASE), r.id
        assert all(part.strip().startswith("https://") for part in r.source.split(";")), r.id


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


# ----- user rule files: every mistake is an InvalidRuleError naming the file and the rule --------
_GOOD = 'effect = "warn"\nmessage = "m"\nsource = "https://example.org"\n'


@pytest.mark.parametrize(
    ("text", "rule", "problem"),
    [
        ("rule = 5\n", "?", "must be an array of tables"),
        ("rule = [5]\n", "#1", "must be a table"),
        ('[[rules]]\nid = "x"\n' + _GOOD, "?", "unknown top-level key"),
        ('[[rule]]\nid = "x"\neffect = "veto"\ntarget = 5\nmessage = "m"\nsource = "s"\n', "x",
         "target must be a string or an array of strings"),
        ('[[rule]]\nid = "x"\n' + _GOOD + "[[rule]\n", "?", "not valid TOML"),
        ('[[rule]]\nid = "x"\nwhen = ["gpus.names matches RTX(50"]\n' + _GOOD, "x",
         "not a valid regular expression"),
        ('[[rule]]\nid = "x"\nwhen = ["gpus.count >="]\n' + _GOOD, "x", "has no value"),
        ('[[rule]]\nid = "x"\nwhen = ["gpus.names matches "]\n' + _GOOD, "x", "has no value"),
        ('[[rule]]\nid = "x"\nwhen = 5\n' + _GOOD, "x", "when must be a string or an array"),
        ('[[rule]]\nid = "x"\nwhen = ["gpus.count >= 2", 3]\n' + _GOOD, "x", "when must be"),
        ('[[rule]]\nid = 5\n' + _GOOD, "#1", "needs an id"),
        ('[[rule]]\nid = "x"\nfirst = "yes"\n' + _GOOD, "x", "first must be true or false"),
        ('[[rule]]\nid = "x"\nmessage = 5\nsource = "s"\neffect = "warn"\n', "x", "message"),
    ],
)
def test_bad_rule_files_name_the_file_and_the_rule(
    tmp_path: Path, text: str, rule: str, problem: str
) -> None:
    f = tmp_path / "mine.toml"
    f.write_text(text, encoding="utf-8")
    with pytest.raises(InvalidRuleError, match=problem) as info:
        load_rules([f])
    assert str(f) in str(info.value)
    assert info.value.rule_id == rule
    # a problem of the file itself names the file, never a rule called '?'
    assert (f"rule {rule!r}" if rule != "?" else "rules file ") in str(info.value)


def test_a_rule_file_that_is_not_utf8_is_a_typed_error(tmp_path: Path) -> None:
    f = tmp_path / "latin1.toml"
    f.write_bytes(b'[[rule]]\nid = "x"\neffect = "warn"\nmessage = "caf\xe9"\nsource = "s"\n')
    with pytest.raises(InvalidRuleError, match="not UTF-8") as info:
        load_rules([f])
    assert str(f) in str(info.value)


def test_unknown_fact_names_are_errors_that_list_the_valid_ones(tmp_path: Path) -> None:
    f = tmp_path / "typo.toml"
    f.write_text('[[rule]]\nid = "two-gpus"\nwhen = ["gpu.count >= 2"]\n' + _GOOD)
    with pytest.raises(InvalidRuleError, match=r"unknown fact 'gpu\.count'") as info:
        load_rules([f])
    text = str(info.value)
    assert "did you mean 'gpus.count'" in text and str(f) in text and "two-gpus" in text
    assert all(name in text for name in FACT_NAMES) and "env.<VARIABLE>" in text
    with pytest.raises(InvalidRuleError, match="unknown fact"):
        parse_clause("not host.wsl")
    assert parse_clause("env.MY_OWN_VARIABLE == 1").fact == "env.MY_OWN_VARIABLE"


def test_fact_names_are_exactly_what_fact_values_computes() -> None:
    facts = machine(2, tensorflow="2.17.0", tf_cuda="12.3", keras="3.5.0",
                    env={"NCCL_DEBUG": "INFO"})
    for fw in ("torch", "tensorflow"):
        names = {k for k in fact_values(facts, fw) if not k.startswith("env.")}
        assert names == set(FACT_NAMES)


def test_matches_regex_is_compiled_when_the_rule_loads() -> None:
    clause = parse_clause("gpus.names matches RTX 50[0-9]0")
    assert clause.pattern is not None and clause.pattern.flags & re.IGNORECASE
    facts = machine(2, name="NVIDIA GeForce RTX 5090", cc=(12, 0))
    assert clause_holds(clause, fact_values(facts, "torch"))
    with pytest.raises(InvalidRuleError, match="regular expression"):
        parse_clause("gpus.names matches [unclosed")


def test_a_bare_path_is_one_rules_file(tmp_path: Path) -> None:
    f = tmp_path / "mine.toml"
    f.write_text('[[rule]]\nid = "lab-rule"\nwhen = ["gpus.count >= 2"]\n' + _GOOD)
    for one in (str(f), f):
        assert "lab-rule" in {r.id for r in load_rules(one)}
    with pytest.raises(InvalidOptionError, match="rules= takes"):
        load_rules([5])  # type: ignore[list-item]


def test_a_bare_string_in_disable_rules_is_one_id() -> None:
    ids_left = {r.id for r in load_rules(disabled="small-dev-shm")}
    assert "small-dev-shm" not in ids_left
    assert ids_left == {r.id for r in RULES} - {"small-dev-shm"}


def test_disabling_an_unknown_rule_id_logs_a_warning_naming_the_known_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        rules = load_rules(disabled=["small-dev-shn", "mixed-gpus"])
    assert "mixed-gpus" not in {r.id for r in rules}
    (record,) = [r for r in caplog.records if r.name == "resilient_strategy"]
    assert record.levelno == logging.WARNING
    assert "small-dev-shn" in record.getMessage() and "small-dev-shm" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        load_rules(disabled=["mixed-gpus"])
    assert not caplog.records


# ----- torch built with CUDA < 12.8 on Blackwell --------------------------------------------
_BLACKWELL = {"name": "NVIDIA GeForce RTX 5090", "cc": (12, 0)}
_TORCHRUN_2 = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}


@pytest.mark.parametrize("env", [_TORCHRUN_2, {}], ids=["torchrun", "one-process"])
def test_torch_cu126_on_blackwell_vetoes_every_gpu_candidate(env: dict[str, str]) -> None:
    # NCCL new enough for Blackwell, so only the CUDA build rules NCCL out
    facts = machine(2, **_BLACKWELL, torch="2.6.0", torch_cuda="12.6", torch_nccl="2.26.2",
                    env=env)
    rid = "torch-cuda-before-12.8-on-blackwell"
    assert rid in ids(facts, "torch")
    sel = simulate(facts, framework="torch", global_batch_size=64)
    assert sel.backend == "cpu" and [c.backend for c in sel.plan.candidates] == ["cpu"]
    vetoed = {r.candidate.backend for r in sel.plan.ruled_out if r.rule == rid}
    assert vetoed == ({"nccl", "gloo", "single_device"} if env else {"single_device"})
    rule = next(r for r in RULES if r.id == rid)
    assert "cu128" in rule.message and "sm_120 is not compatible" in rule.message
    assert "https://github.com/pytorch/pytorch/issues/150733" in rule.source


@pytest.mark.parametrize(
    "kw",
    [
        {**_BLACKWELL, "torch_cuda": "12.8"},  # a cu128 build has Blackwell kernels
        {**_BLACKWELL, "torch_cuda": "13.0"},
        {**_BLACKWELL, "torch_cuda": None, "torch_nccl": None},  # CPU build: planned as CPU anyway
        {"name": "NVIDIA H100 80GB HBM3", "cc": (9, 0), "torch_cuda": "12.6"},
    ],
)
def test_torch_cuda_rule_needs_blackwell_and_an_old_cuda_build(kw: dict[str, Any]) -> None:
    assert "torch-cuda-before-12.8-on-blackwell" not in ids(machine(2, **kw), "torch")


def test_torch_cuda_rule_does_not_apply_to_tensorflow() -> None:
    facts = machine(2, **_BLACKWELL, torch_cuda="12.6", tensorflow="2.20.0", tf_cuda="12.5")
    assert "torch-cuda-before-12.8-on-blackwell" not in ids(facts, "tensorflow")


def test_every_builtin_source_is_or_carries_a_link() -> None:
    for r in RULES:
        parts = [p.strip() for p in r.source.split(";")]
        assert any(p.startswith("https://") for p in parts), r.id


def test_an_unread_compute_capability_fires_no_cc_rule() -> None:
    from resilient_strategy.testing import gpu

    unread = [gpu(i, cc=(0, 0)) for i in range(2)]
    facts = machine(unread, env={"WORLD_SIZE": "2"})
    values = fact_values(facts, "torch")
    assert values["gpus.min_cc"] is None and values["gpus.max_cc"] is None
    fired_ids = {r.id for r in fired(load_rules(), facts, "torch")}
    assert "nccl-cuda13-drops-pre-turing" not in fired_ids  # would veto NCCL on (0, 0) < 7.5


@pytest.mark.parametrize("kind", ["fifo", "huge", "deep", "directory"])
def test_a_rules_file_that_cannot_be_read_safely_is_an_invalid_rule_error(
    tmp_path: Path, kind: str
) -> None:
    f = tmp_path / "rules.toml"
    if kind == "fifo":  # opening it would wait for a writer forever
        os.mkfifo(f)
    elif kind == "huge":
        with open(f, "wb") as fh:
            fh.truncate(400 << 20)  # sparse
    elif kind == "deep":
        f.write_text("x = " + "[" * 200_000 + "]" * 200_000)
    else:
        f.mkdir()
    with pytest.raises(InvalidRuleError, match=r"rules\.toml"):
        load_rules([f])


def test_a_small_dev_shm_in_a_pod_gets_the_pod_fix_not_dockers() -> None:
    pod = machine(4, shm_mb=64, container="kubernetes")
    docker = machine(4, shm_mb=64, container="docker")
    assert "small-dev-shm-pod" in ids(pod, "torch") and "small-dev-shm" not in ids(pod, "torch")
    assert "small-dev-shm" in ids(docker, "torch") and "small-dev-shm-pod" not in ids(docker,
                                                                                      "torch")
    # the same remedy either way (SHM off first); the pod rule's advice is a pod spec's
    sel = simulate(pod, framework="torch", global_batch_size=64, dry_run=True,
                   env={"WORLD_SIZE": "4"})
    assert "small-dev-shm-pod" in sel.plan.rules_fired
    assert sel.plan.candidates[0].env == (("NCCL_SHM_DISABLE", "1"),)


def test_advice_names_the_suspect_version_and_the_fix() -> None:
    from resilient_strategy.core.trace.ruling import RuleFired

    h100 = machine(4, name="NVIDIA H100 80GB HBM3", cc=(9, 0), torch_cuda="11.8",
                   torch_nccl="2.14.3")
    assert "torch-nccl-before-hopper" in ids(h100, "torch")
    assert "torch-nccl-before-hopper" not in ids(
        machine(4, name="NVIDIA H100 80GB HBM3", cc=(9, 0), torch_nccl="2.18.1"), "torch")
    sel = simulate(h100, framework="torch", global_batch_size=64, dry_run=True,
                   env={"WORLD_SIZE": "4"})
    fired_ = [e for e in sel.plan.events if isinstance(e, RuleFired)
              and e.rule == "torch-nccl-before-hopper"]
    assert len(fired_) == 1 and "2.14.3" in fired_[0].message  # the installed version, filled
    # a driver whose CUDA is older than the build's: fires with the driver's versions
    old = machine(2, driver="535.129.03", driver_cuda="12.2", torch_cuda="12.4")
    assert "driver-older-than-cuda-build" in ids(old, "torch")
    assert "driver-older-than-cuda-build" not in ids(
        machine(2, driver="550.54.14", driver_cuda="12.4", torch_cuda="12.4"), "torch")
    assert "driver-older-than-cuda-build" not in ids(machine(2, driver_cuda=None), "torch")
    msg = next(r.message for r in fired(RULES, old, "torch")
               if r.id == "driver-older-than-cuda-build")
    assert "535.129.03" in msg and "12.2" in msg


def test_error_804_is_the_driver_for_every_gpu_of_the_process() -> None:
    from resilient_strategy.testing import FakeProber

    text = ("fails:RuntimeError: Unexpected error from cudaGetDeviceCount(). Error 804: "
            "forward compatibility was attempted on non supported HW")
    prober = FakeProber({"*": text})
    sel = simulate(machine(2, env={"WORLD_SIZE": "2"}), prober, framework="torch",
                   global_batch_size=64)
    assert sel.backend == "cpu" and prober.probed == ["nccl"]
    assert next(iter(sel.results.values())).cause == "driver_too_old"


def test_a_fabric_manager_out_of_step_with_the_driver_is_named_with_both_versions() -> None:
    split = machine(8, nvlink=18, driver="530.41.03",
                    platform_facts={"nvswitch": True, "fabric_manager": "530.30.02"})
    same = machine(8, nvlink=18, driver="530.41.03",
                   platform_facts={"nvswitch": True, "fabric_manager": "530.41.03"})
    assert "fabric-manager-driver-mismatch" in ids(split, "torch")
    assert "fabric-manager-driver-mismatch" not in ids(same, "torch")
    assert "fabric-manager-driver-mismatch" not in ids(machine(8, nvlink=18), "torch")
    msg = next(r.message for r in fired(RULES, split, "torch")
               if r.id == "fabric-manager-driver-mismatch")
    assert "530.30.02" in msg and "530.41.03" in msg
