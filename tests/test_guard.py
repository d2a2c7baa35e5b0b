from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

from resilient_strategy.core.values.facts import Facts, FrameworkInfo
from resilient_strategy.errors import FrameworkInitializedError
from resilient_strategy.machine import guard

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _python(code: str, *paths: Path, timeout: float = 60) -> str:
    """Run ``code`` in a fresh interpreter with ``paths`` then the repo's src on PYTHONPATH."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([*map(str, paths), SRC]),
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=env, timeout=deadline(timeout), check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def _files(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


FAKE_FRAMEWORKS = {"torch/__init__.py": "", "tensorflow/__init__.py": "", "keras/__init__.py": ""}


# ----- the import watch ----------------------------------------------------------------------
def test_watch_names_the_exact_line_of_each_import(tmp_path: Path) -> None:
    _files(tmp_path, {**FAKE_FRAMEWORKS, "app/model.py": """\
        '''A user module.'''
        import os

        import torch  # line 4


        def later():
            import importlib
            return importlib.import_module("tensorflow")  # line 9
        """})
    out = _python("""
        import json, resilient_strategy
        from resilient_strategy.machine.guard import first_import_site
        import app.model
        app.model.later()
        print(json.dumps([first_import_site(n) for n in ("torch", "tensorflow", "keras")]))
        """, tmp_path)
    torch_site, tf_site, keras_site = json.loads(out)
    assert torch_site == f"{tmp_path / 'app' / 'model.py'}:4"
    assert tf_site == f"{tmp_path / 'app' / 'model.py'}:9"
    assert keras_site is None


def test_find_spec_is_not_an_import(tmp_path: Path) -> None:
    _files(tmp_path, {**FAKE_FRAMEWORKS, "user.py": "import json\nimport torch\n"})
    out = _python("""
        import importlib.util, json, resilient_strategy
        from resilient_strategy.machine.guard import first_import_site
        from resilient_strategy.machine.inspect import detect_facts
        importlib.util.find_spec("torch")
        detect_facts()  # looks the frameworks up with find_spec too
        before = first_import_site("torch")
        import user
        print(json.dumps([before, first_import_site("torch")]))
        """, tmp_path)
    assert json.loads(out) == [None, f"{tmp_path / 'user.py'}:2"]


def test_import_through_a_third_party_library_names_the_user_line(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    _files(site, {**FAKE_FRAMEWORKS, "thirdlib/__init__.py": "import tensorflow\n"})
    _files(tmp_path, {"train.py": "import sys\nimport thirdlib  # line 2\n"})
    out = _python("""
        import resilient_strategy
        import train
        print(resilient_strategy.machine.guard.first_import_site("tensorflow"))
        """, tmp_path, site)
    assert out == f"{tmp_path / 'train.py'}:2"


def test_framework_imported_before_the_package(tmp_path: Path) -> None:
    _files(tmp_path, FAKE_FRAMEWORKS)
    out = _python("""
        import torch
        import resilient_strategy
        print(resilient_strategy.machine.guard.first_import_site("torch"))
        """, tmp_path)
    assert out == guard.ALREADY_IMPORTED


@pytest.mark.slow
def test_watch_with_the_real_torch(tmp_path: Path) -> None:
    if not importlib.util.find_spec("torch"):
        pytest.skip("torch not installed")
    _files(tmp_path, {"net.py": "# a model file\n\nimport torch.nn as nn  # line 3\n"})
    out = _python("""
        import resilient_strategy, net
        print(resilient_strategy.machine.guard.first_import_site("torch"))
        """, tmp_path, timeout=120)
    assert out == f"{tmp_path / 'net.py'}:3"


def test_install_is_idempotent() -> None:
    guard.install_import_watch()
    guard.install_import_watch()
    watches = [f for f in sys.meta_path if isinstance(f, guard.ImportWatch)]
    assert watches == [guard.IMPORT_WATCH]
    assert not guard.ImportWatch().install()  # a second watch is never added


def test_a_lookup_that_is_no_import_records_nothing() -> None:
    watch = guard.ImportWatch({"torch"})
    assert watch.find_spec("json") is None
    assert watch.find_spec("torch") is None  # called directly: no import is running
    assert watch.pending == {"torch"} and watch.site("torch") is None
    watch.record("torch", "train.py:3")
    watch.record("torch", "later.py:9")  # the first import is the one kept
    assert watch.pending == set() and guard.first_import_site("torch", watch) == "train.py:3"


# ----- the initialized-framework check ------------------------------------------------------
def _facts(**tf: Any) -> Facts:
    return Facts(frameworks=(FrameworkInfo(name="tensorflow", version="2.15.1", **tf),))


def test_initialized_framework_and_a_change_raises() -> None:
    facts = _facts(imported=True, gpu_initialized=True, imported_at="src/utils/debug.py:7")
    with pytest.raises(FrameworkInitializedError) as err:
        guard.check_visible_devices_settable(facts, ["tensorflow"], "0,1", None)
    assert err.value.framework == "tensorflow"
    assert err.value.imported_at == "src/utils/debug.py:7"
    assert "debug.py:7" in str(err.value) and "'0,1'" in str(err.value)


@pytest.mark.parametrize(
    ("tf", "frameworks", "wanted", "current", "raises"),
    [
        ({"imported": True, "gpu_initialized": True}, ["tensorflow"], "0", None, True),
        ({"imported": True, "gpu_initialized": True}, ["tensorflow"], None, None, False),  # no change
        ({"imported": True, "gpu_initialized": True}, ["tensorflow"], "0", "0", False),  # same value
        ({"imported": True, "gpu_initialized": True}, ["torch"], "0", None, False),  # TF not asked
        ({"imported": True, "imported_at": "x.py:1"}, ["tensorflow"], "0", None, False),  # no GPU yet
    ],
)
def test_only_a_started_framework_and_a_real_change_raise(
    tf: dict[str, Any], frameworks: list[str], wanted: str | None, current: str | None,
    raises: bool,
) -> None:
    try:
        guard.check_visible_devices_settable(_facts(**tf), frameworks, wanted, current)
        raised = False
    except FrameworkInitializedError:
        raised = True
    assert raised == raises


@pytest.mark.slow
def test_seed_000_tf_imported_in_a_utility_module_names_debug_py_7(tmp_path: Path) -> None:
    """Seed 000: TF imported at module level in src/utils/debug.py, then GPUs initialized."""
    if not importlib.util.find_spec("tensorflow"):
        pytest.skip("tensorflow not installed")
    src = _files(tmp_path / "src", {"utils/__init__.py": "", "utils/debug.py": """\
        '''Debug helpers.'''
        import json
        import logging
        import os

        log = logging.getLogger(__name__)
        import tensorflow as tf  # line 7


        def devices():
            return tf.config.list_physical_devices()
        """})
    out = _python("""
        import json
        import resilient_strategy
        from resilient_strategy.machine.guard import check_visible_devices_settable
        from resilient_strategy.machine.inspect import detect_facts
        from utils import debug
        imported_only = detect_facts(env={}).framework("tensorflow")
        check_visible_devices_settable(detect_facts(env={}), ["tensorflow"], "0", None)
        debug.devices()  # the GPU runtime starts here
        facts = detect_facts(env={})
        try:
            check_visible_devices_settable(facts, ["tensorflow"], "0", None)
            message = None
        except resilient_strategy.FrameworkInitializedError as exc:
            message = str(exc)
        print(json.dumps([imported_only.imported, imported_only.gpu_initialized, message]))
        """, src, timeout=180)
    imported, initialized, message = json.loads(out)
    assert (imported, initialized) == (True, False)
    assert message is not None
    assert "tensorflow already initialized the GPUs" in message
    assert f"{src / 'utils' / 'debug.py'}:7" in message and "debug.py:7" in message
