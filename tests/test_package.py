"""The package as a user meets it: import cost, laziness, the pytest plugin, typed errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import deadline

import resilient_strategy

SRC = str(Path(__file__).parents[1] / "src")


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=deadline(120), env={**os.environ, "PYTHONPATH": SRC, **env})


def test_import_imports_no_framework_and_does_no_gpu_work() -> None:
    out = _python(
        "import sys; import resilient_strategy as rs; "
        "bad = sorted(m for m in ('torch', 'tensorflow', 'keras', 'jax', 'pynvml', 'numpy', "
        "'subprocess') if m in sys.modules); print(bad)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_lazy_attributes_resolve() -> None:
    assert resilient_strategy.resilient_strategy.__name__ == "resilient_strategy"
    assert issubclass(resilient_strategy.NoWorkingStrategyError, resilient_strategy.ResilientStrategyError)
    assert "resilient_strategy" in dir(resilient_strategy)
    with pytest.raises(AttributeError):
        _ = resilient_strategy.not_a_thing  # type: ignore[attr-defined]


def test_bad_cuda_visible_devices_is_a_typed_error() -> None:
    from resilient_strategy.core.values.facts import Facts, FrameworkInfo
    from resilient_strategy.errors import InvalidVisibleDevicesError
    from resilient_strategy.machine.visible import PhysicalGpu, parse_visible_devices
    from resilient_strategy.testing import gpu, simulate

    phys = [PhysicalGpu(index=i, uuid=f"GPU-{i}aaa", name="NVIDIA H200") for i in range(2)]
    vis = parse_visible_devices("GPU-zzz", phys)
    facts = Facts(gpus=(), visibility=vis, frameworks=(FrameworkInfo("torch", "2.11", cuda="13.0"),))
    with pytest.raises(InvalidVisibleDevicesError, match="GPU-zzz"):
        simulate(facts)
    assert gpu(0).index == 0


def test_pytest_plugin_fixture(request: pytest.FixtureRequest) -> None:
    if not request.config.pluginmanager.has_plugin("resilient_strategy"):
        pytest.skip("the package is not installed (its pytest11 entry point registers the "
                    "plugin): run from PYTHONPATH")
    rs_sim = request.getfixturevalue("rs_sim")
    sel = rs_sim.simulate(rs_sim.machine(2, name="NVIDIA GeForce RTX 4090", cc=(8, 9),
                                         env={"WORLD_SIZE": "2"}),
                          {"nccl": "timeout", "nccl+*": "timeout"}, global_batch_size=64,
                          gradient_bytes=100_000_000)
    assert sel.backend == "single_device" and sel.accumulation_steps == 2


@pytest.mark.slow
def test_the_built_wheel_ships_every_data_file_and_decides(tmp_path: Path) -> None:
    """The wheel is what users get: build it, check every shipped table is in it, and make a
    real (dry-run) decision and a `doctor` from the unpacked wheel alone, not from src/."""
    import zipfile

    from resilient_strategy.core.knowledge.data import DATA_FILES

    root = Path(__file__).parents[1]
    import setuptools

    if int(setuptools.__version__.split(".")[0]) < 77:  # pyproject's build requirement
        pytest.skip(f"setuptools {setuptools.__version__} here, the build needs >= 77 (.ci/run "
                    "builds the wheel in isolation and decides from it)")
    on_disk = sorted(p.name for p in (root / "src/resilient_strategy/core/knowledge").glob("*.toml"))
    assert on_disk == sorted(DATA_FILES), "a data file on disk is not in core/knowledge/data.DATA_FILES"
    # build from a clean copy: an egg-info left by an editable install lists files the
    # package data would not, and hides the bug this test exists for
    tree = tmp_path / "tree"
    shutil.copytree(root / "src", tree / "src",
                    ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(root / name, tree / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(tree)],
        capture_output=True, text=True, timeout=deadline(300))
    if built.returncode != 0 and "No module named" in built.stderr:
        pytest.skip(f"cannot build a wheel here: {built.stderr.strip()[-200:]}")
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("resilient_strategy-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        zf.extractall(tmp_path / "site")
    missing = [n for n in DATA_FILES if f"resilient_strategy/core/knowledge/{n}" not in names]
    assert missing == []
    site = str(tmp_path / "site")
    code = ("import json, resilient_strategy as rs; "
            f"assert rs.__file__.startswith({site!r}), rs.__file__; "
            "sel = rs.resilient_strategy(framework='torch', dry_run=True, probe='never'); "
            "print(json.dumps({'backend': sel.backend, 'n': sel.num_replicas}))")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"),
           "RESILIENT_STRATEGY_CACHE_DIR": str(tmp_path / "cache")}
    decided = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=deadline(120), env=env, cwd=tmp_path)
    assert decided.returncode == 0, decided.stderr
    assert json.loads(decided.stdout.strip().splitlines()[-1])["backend"] in {
        "nccl", "gloo", "single_device", "cpu", "hierarchical_copy", "reduction_to_one_device"}
    doctor = subprocess.run([sys.executable, "-m", "resilient_strategy", "doctor", "--json"],
                            capture_output=True, text=True, timeout=deadline(120), env=env, cwd=tmp_path)
    assert doctor.returncode == 0, doctor.stderr
    assert json.loads(doctor.stdout)["facts"]
