"""An option is described once (issue 44 item 2): its field in ``core/call/fields.py`` gives the
keyword and its default, the validated value's field, the command-line flag, the environment
variable and the reference docs' row. Each is derived here from the fields and compared with
what the code and the pages really have (the signature, the dataclasses, the argparse parser's
actions, the variables the readers name, the committed tables): a disagreement fails."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import inspect
import math
import re
from pathlib import Path
from typing import Any

import pytest

from resilient_strategy.core.call.arguments import Arguments, options_from, run_options_from
from resilient_strategy.core.call.fields import CALL, CALL_FIELDS, RUN, RUN_FIELDS, OptionField
from resilient_strategy.core.call.options import Options, RunOptions
from resilient_strategy.errors import InvalidOptionError
from resilient_strategy.run.cmdline import own_parser, parser
from resilient_strategy.testing import machine

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "resilient_strategy"
#: The command line's arguments that are not our options: argparse's help, torchrun's
#: process count (spelt as torchrun spells it), the script and its arguments.
NOT_OURS = {"help", "nproc_per_node", "training_script", "training_script_args"}
#: Keywords folded into another field of `Options`: the model into its sizes, the rule ids into
#: the rules, the cache switch into the cache directory (None: no cache).
FOLDED = {"model", "disable_rules", "cache"}


def _gen_options() -> Any:
    spec = importlib.util.spec_from_file_location("gen_options", ROOT / "docs" / "gen_options.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_keywords_are_the_fields_in_the_signatures_order_with_their_defaults() -> None:
    from resilient_strategy.deciding.executor import resilient_strategy

    params = inspect.signature(resilient_strategy).parameters
    keywords = {p: v.default for p, v in params.items()
                if v.kind is not v.VAR_KEYWORD and p not in ("env", "facts")}
    assert list(keywords) == [f.name for f in CALL_FIELDS]
    assert keywords == {f.name: f.default for f in CALL_FIELDS}
    assert Arguments().flat() == {f.name: f.default for f in CALL_FIELDS}
    assert set(Arguments.names()) == set(CALL)


def test_each_option_keeps_its_name_into_the_validated_value() -> None:
    """One name from the user to the value: the keyword or flag's name, its unit at most."""
    options = {f.name: f for f in dataclasses.fields(Options)}
    run = {f.name: f for f in dataclasses.fields(RunOptions)}
    for f in CALL_FIELDS:
        assert f.unit in ("", "_s")
        assert f.field in options or f.name in FOLDED, f.name
    for f in RUN_FIELDS:
        assert f.unit in ("", "_s")
        assert f.field in run, f.name
    # where our default is a value, the validated value's own default is that value
    for f in CALL_FIELDS:
        want = f.fallback if f.fallback is not None else f.default
        if f.field in options and want is not None and not isinstance(want, tuple):
            assert options[f.field].default == want, f.name
    for f in RUN_FIELDS:
        want = f.fallback if f.fallback is not None else f.default
        if f.name in ("probe_timeout", "optimizer_state_factor"):
            # RunOptions keeps None (not given): the decision's reader falls back to ours
            assert run[f.field].default is None, f.name
        else:
            assert run[f.field].default == want, f.name


def _actions(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in p._actions}


@pytest.mark.parametrize("with_torch", [False, True])
def test_runs_flags_are_the_fields(with_torch: bool) -> None:
    if with_torch:
        pytest.importorskip("torch")
    actions = _actions(parser(with_torch=True) if with_torch else own_parser())
    for f in RUN_FIELDS:
        a = actions[f.name]
        assert f.flag in a.option_strings, f.name
        assert a.default == f.default, f.name
        assert list(a.choices or ()) == list(f.choices), f.name
        want_type = {"integer": int, "seconds": float, "number": float}.get(f.kind)
        assert a.type is want_type, f.name
        assert isinstance(a, argparse.BooleanOptionalAction) == (f.kind == "onoff"), f.name
        assert a.help is not None and f.help.replace("%", "%%") in a.help
    if not with_torch:  # every flag of run's own parser is a field (torchrun's are torchrun's)
        assert set(actions) - NOT_OURS == set(RUN)


def test_a_flag_value_out_of_its_fields_range_is_refused_naming_the_flag(tmp_path: Path) -> None:
    from resilient_strategy.run.cmdline import options_from_args

    script = tmp_path / "train.py"
    script.write_text("import tensorflow\n")
    for f in RUN_FIELDS:
        if f.kind not in ("integer", "seconds", "number"):
            continue
        assert f.high is not None
        bad = str(int(f.high) + 1) if f.kind == "integer" else repr(f.high * 2)
        with pytest.raises(InvalidOptionError) as err:
            options_from_args(["--framework", "tensorflow", f.flag, bad, str(script)])
        assert err.value.option == f.flag


def _string_constants(path: Path) -> set[str]:
    """The string constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in docs}


def test_each_options_variable_is_named_once_in_the_source() -> None:
    """The readers take the variable's name from the field: a variable written out anywhere
    else is a second description of it."""
    names = {f.env for f in (*CALL_FIELDS, *RUN_FIELDS) if f.env}
    fields_module = SRC / "core" / "call" / "fields.py"
    assert names <= _string_constants(fields_module)
    elsewhere = {str(p.relative_to(SRC)): sorted(names & _string_constants(p))
                 for p in SRC.rglob("*.py") if p != fields_module}
    assert {p: n for p, n in elsewhere.items() if n} == {}


H200X2 = machine(2, nvlink=18)


def _bad_text(f: OptionField) -> str:
    if f.kind in ("switch", "onoff"):
        return "maybe"
    if f.kind == "choice":
        return "no-such-choice"
    assert f.high is not None
    return str(int(f.high) + 1) if f.kind == "integer" else repr(f.high * 2)


@pytest.mark.parametrize("f", [f for f in CALL_FIELDS if f.env and f.kind != "value"
                               and f.kind != "text"], ids=lambda f: f.name)
def test_a_bad_value_in_a_keywords_variable_is_refused_naming_it(f: OptionField) -> None:
    env = {f.env: _bad_text(f)}
    with pytest.raises(InvalidOptionError) as err:
        options_from(H200X2, env, Arguments.from_kwargs(framework="torch", cache=False))
    assert err.value.option == f.env
    # and the keyword, given, wins over the variable (explicit argument > environment)
    if f.kind in ("seconds", "choice", "onoff"):
        good: Any = f.choices[0] if f.kind == "choice" else {"seconds": 5.0, "onoff": True}[f.kind]
        o = options_from(H200X2, env, Arguments.from_kwargs(
            framework="torch", cache=False, **{f.name: good}))
        assert getattr(o, f.field) == good


@pytest.mark.parametrize("f", [f for f in RUN_FIELDS if f.env], ids=lambda f: f.name)
def test_a_bad_value_in_a_flags_variable_is_refused_naming_it(f: OptionField) -> None:
    base: dict[str, Any] = dict(script="train.py", script_args=(), framework="torch", nproc="1",
                                max_relaunches=None, stall_timeout=None, global_batch_size=None,
                                gradient_bytes=None, probe_timeout=None, logical_cpus=0)
    with pytest.raises(InvalidOptionError) as err:
        run_options_from({f.env: _bad_text(f)}, **base)
    assert err.value.option == f.env
    if f.kind == "onoff":  # an on/off variable is checked even where its flag is given
        return             # (`check_environment`: a typo is never silently ignored)
    good = {"integer": 3, "seconds": 5.0}[f.kind]
    given = run_options_from({f.env: _bad_text(f)}, **{**base, f.name: good})
    assert getattr(given, f.field) == good


def test_the_range_check_is_the_fields_own() -> None:
    """The value's check and the field's agree at the edges of every numeric range."""
    for f in (*CALL_FIELDS, *RUN_FIELDS):
        if f.kind not in ("integer", "seconds", "number"):
            continue
        assert f.high is not None
        assert f.expected(f.high) is None and f.expected(math.inf) is not None, f.name
        low = f.low if f.kind != "seconds" else 0.0
        assert low is not None
        assert (f.expected(low) is None) == (f.kind != "seconds"), f.name
        if f.kind == "integer":
            assert f.expected(int(f.high) + 1) is not None and f.expected(True) is not None
    with pytest.raises(InvalidOptionError) as err:
        Options("torch", timeout_s=CALL["timeout"].high + 1)  # type: ignore[operator]
    assert err.value.option == "timeout"
    with pytest.raises(InvalidOptionError) as err:
        RunOptions("train.py", stall_timeout_s=-1.0)
    assert err.value.option == "--stall-timeout"


def _table_rows(page: Path, name: str) -> list[list[str]]:
    text = page.read_text(encoding="utf-8")
    block = text.split(f"<!-- options:{name}:begin -->", 1)[1].split(
        f"<!-- options:{name}:end -->", 1)[0]
    rows = [ln for ln in block.splitlines() if ln.startswith("| ")]
    return [[c.strip() for c in row.strip("|").split(" | ")] for row in rows[1:]]


def test_the_docs_tables_are_the_fields() -> None:
    gen = _gen_options()
    for page, (name, fields) in gen.PAGES.items():
        text = page.read_text(encoding="utf-8")
        assert gen.render(text, name, fields) == text, (
            f"{page.name}: run python docs/gen_options.py")
        rows = _table_rows(page, name)
        assert [re.findall(r"`([^`]+)`", r[0])[0] for r in rows] == [
            f.flag or f.name for f in fields]
        assert [r[3].strip("`") for r in rows] == [f.env for f in fields]
        assert [r[2] for r in rows] == [f.default_text() for f in fields]


def test_the_environment_page_lists_every_options_variable_with_its_option() -> None:
    text = (ROOT / "docs" / "reference" / "environment.md").read_text(encoding="utf-8")
    rows = {m.group(1): m.group(2) for m in re.finditer(
        r"^\| `(RESILIENT_STRATEGY_\w+)` \|.*\| ([^|]*) \|$", text, re.M)}
    for f in (*CALL_FIELDS, *RUN_FIELDS):
        if f.env:
            assert f.env in rows, f.env
            assert (f.flag or f"{f.name}=") in rows[f.env], f.env
