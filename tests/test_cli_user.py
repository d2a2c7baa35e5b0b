"""The command line as a new user meets it: --version, clean errors that name what is wrong,
help without markup, and the launch a plan assumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resilient_strategy.cli import build_parser, main


def _sim(tmp_path: Path, data: object) -> str:
    f = tmp_path / "m.json"
    f.write_text(json.dumps(data))
    return str(f)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("resilient-strategy ")


def test_unknown_disabled_rule_is_an_error_listing_known_ids(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--disable-rule", "consumer-pcie-p2", "--framework", "torch"]) == 2
    err = capsys.readouterr().err
    assert "consumer-pcie-p2" in err and "consumer-pcie-p2p" in err  # the typo and the real id


@pytest.mark.torch  # plans for torch: skipped where only TensorFlow is installed
def test_known_disabled_rule_is_accepted() -> None:
    assert main(["plan", "--disable-rule", "consumer-pcie-p2p", "--framework", "torch"]) == 0


@pytest.mark.parametrize("data, named", [
    ({}, '"machine"'),
    ({"machine": {}}, '"gpus"'),
    ({"machine": {"gpus": 2, "torch_archs": 5}}, "torch_archs"),
    ({"facts": {"gpus": 3, "frameworks": []}}, "facts.gpus"),
    ({"facts": {"gpus": [], "frameworks": [], "host": 3}}, "facts.host"),
    ({"facts": {"gpus": [{"index": "zero"}], "frameworks": []}}, "facts.gpus[0].index"),
])
def test_simulation_errors_name_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          data: object, named: str) -> None:
    assert main(["plan", "--simulate", _sim(tmp_path, data)]) == 2
    err = capsys.readouterr().err
    assert named in err and "not iterable" not in err


@pytest.mark.torch
def test_missing_rules_file_names_the_file(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.toml"
    assert main(["plan", "--rules", str(missing), "--framework", "torch"]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "'?'" not in err


def test_help_has_no_raw_markup() -> None:
    parser = build_parser()
    texts = [parser.format_help()]
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        texts += [p.format_help() for p in action.choices.values()]  # type: ignore[union-attr]
    assert texts and not any("``" in t for t in texts)


def test_plan_says_which_launch_it_assumes(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    two = _sim(tmp_path, {"machine": {"gpus": 2}, "framework": "torch"})
    assert main(["plan", "--simulate", two]) == 0
    assert "torchrun --nproc_per_node 2" in capsys.readouterr().out
    assert main(["plan", "--simulate", two, "--nproc-per-node", "1"]) == 0
    out = capsys.readouterr().out
    assert "plain python" in out and "torchrun" not in out.split("Why:")[0]
    assert main(["plan", "--simulate", two, "--nproc-per-node", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["decisions"]["torch"]["world_size"] == 2


def test_no_framework_installed_plans_nothing_and_exits_0(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bare = _sim(tmp_path, {"machine": {"gpus": 2, "torch": None}})
    assert main(["doctor", "--simulate", bare]) == 0
    out = capsys.readouterr().out
    assert "== torch ==" not in out and "== tensorflow ==" not in out and "--simulate" in out
