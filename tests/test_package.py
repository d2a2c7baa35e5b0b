"""The package as a user meets it: import cost, laziness, the pytest plugin, typed errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import resilient_strategy

SRC = str(Path(__file__).parents[1] / "src")


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": SRC, **env})


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
    from resilient_strategy.core.facts import Facts, FrameworkInfo
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
