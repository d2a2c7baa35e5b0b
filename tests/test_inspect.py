from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from _fake_nvml import a100_mig, a6000x4, h200x2, no_driver, rtx5090x2
from conftest import deadline

from resilient_strategy.core.values.facts import Facts, Link
from resilient_strategy.machine import guard
from resilient_strategy.machine.inspect import detect_facts

SRC = str(Path(__file__).resolve().parents[1] / "src")


def facts(env: dict[str, str], nvml: object, tmp_path: Path) -> Facts:
    return detect_facts(env, nvml=nvml, root=str(tmp_path), modules={})


def test_h200x2_all_visible(tmp_path: Path) -> None:
    f = facts({"NCCL_DEBUG": "INFO", "HOME": "/root"}, h200x2(), tmp_path)
    assert [(g.index, g.physical_index, g.name, g.cc) for g in f.gpus] == [
        (0, 0, "NVIDIA H200", "9.0"), (1, 1, "NVIDIA H200", "9.0"),
    ]
    assert f.links == (Link(0, 1, "hostbridge", 18, "ok", "ok"),)
    assert (f.driver_version, f.cuda_driver_version, f.nvml_error) == ("580.159.04", "13.0", None)
    assert f.visibility.raw is None and f.visibility.physical == (0, 1)
    assert f.env == (("NCCL_DEBUG", "INFO"),)
    assert [fw.name for fw in f.frameworks] == ["torch", "tensorflow", "keras"]
    assert Facts.from_dict(json.loads(json.dumps(f.to_dict()))).fingerprint() == f.fingerprint()


def test_visible_order_renumbers_gpus_and_links(tmp_path: Path) -> None:
    f = facts({"CUDA_VISIBLE_DEVICES": "2,0,3"}, a6000x4(), tmp_path)
    assert [(g.index, g.physical_index) for g in f.gpus] == [(0, 2), (1, 0), (2, 3)]
    # physical 2-3 (bridged) -> job 0-2; physical 0-2 -> job 0-1; physical 0-3 -> job 1-2
    assert [(ln.a, ln.b, ln.nvlinks) for ln in f.links] == [(0, 1, 0), (0, 2, 4), (1, 2, 0)]
    assert all(ln.a < ln.b for ln in f.links)


def test_uuid_selection_and_hidden_gpus(tmp_path: Path) -> None:
    nv = rtx5090x2()
    f = facts({"CUDA_VISIBLE_DEVICES": nv.gpus[1].uuid}, nv, tmp_path)
    assert [(g.index, g.physical_index, g.uuid) for g in f.gpus] == [(0, 1, nv.gpus[1].uuid)]
    assert f.gpus[0].is_consumer and f.links == ()
    none = facts({"CUDA_VISIBLE_DEVICES": "-1"}, nv, tmp_path)
    assert none.gpus == () and none.nvml_error is None


def test_invalid_entry_is_noted(tmp_path: Path) -> None:
    f = facts({"CUDA_VISIBLE_DEVICES": "1,4"}, h200x2(), tmp_path)
    assert [g.physical_index for g in f.gpus] == [1]
    assert "'4' is out of range" in f.visibility.notes[0]


def test_mig_instance_is_a_gpu(tmp_path: Path) -> None:
    nv = a100_mig()
    mig = nv.gpus[0].mig[1]  # type: ignore[index]
    f = facts({"CUDA_VISIBLE_DEVICES": mig.uuid}, nv, tmp_path)
    (gpu,) = f.gpus
    assert (gpu.index, gpu.physical_index, gpu.uuid) == (0, 0, mig.uuid)
    assert gpu.name == "NVIDIA A100-SXM4-40GB MIG 3g.20gb" and gpu.mig_enabled
    assert gpu.memory_bytes == mig.mem and gpu.cc == "8.0"
    assert f.links == ()


def test_no_driver_gives_zero_gpus_and_a_reason(tmp_path: Path) -> None:
    f = facts({"CUDA_VISIBLE_DEVICES": "0,1"}, no_driver(), tmp_path)
    assert f.gpus == () and f.links == ()
    assert f.nvml_error is not None and "no NVIDIA driver" in f.nvml_error
    assert f.visibility.raw == "0,1" and f.visibility.physical == ()


def test_env_argument_wins_over_os_environ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert facts({}, h200x2(), tmp_path).visibility.physical == (0, 1)


class _KerasOnly:
    """A metadata source with keras installed, whatever this machine has (a GPU box may have
    torch only)."""

    def distribution(self, name: str) -> object:
        if name == "keras":
            return SimpleNamespace(version="3.0.0", requires=[])
        raise importlib.metadata.PackageNotFoundError(name)

    def version(self, name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    def package_dir(self, name: str) -> str | None:
        return None


def test_imported_at_comes_from_the_import_watch(tmp_path: Path) -> None:
    watch = guard.ImportWatch()
    watch.record("keras", "train.py:3")
    f = detect_facts({}, nvml=no_driver(), root=str(tmp_path), modules={"keras": object()},
                     imports=watch, packages=_KerasOnly())
    assert f.framework("keras").imported_at == "train.py:3"
    assert f.framework("torch").imported_at is None


def test_this_machine_without_gpus_in_a_fresh_process() -> None:
    code = """
        import json, sys
        from resilient_strategy.machine.inspect import detect_facts
        f = detect_facts()
        heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorflow', 'keras')]
        print(json.dumps([len(f.gpus), f.nvml_error, heavy, f.visibility.raw]))
        """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": SRC}, timeout=deadline(60), check=False,
    )
    assert out.returncode == 0, out.stderr
    n, error, heavy, visible = json.loads(out.stdout)
    assert heavy == []
    if n == 0 and visible != "":  # no GPU, and not hidden (conftest hides a GPU machine's)
        assert error is not None and error != ""


def test_unreadable_values_reach_the_facts_and_the_trace(tmp_path: Path) -> None:
    from dataclasses import replace

    from resilient_strategy.core.trace.event import Note
    from resilient_strategy.testing import machine, simulate

    nv = h200x2()
    nv.gpus[1].fail = {"nvmlDeviceGetCudaComputeCapability"}
    f = facts({"WORLD_SIZE": "2"}, nv, tmp_path)
    assert f.gpus[1].compute_capability == (0, 0)
    assert any("GPU 1 compute capability: unknown" in n for n in f.nvml_notes)
    assert Facts.from_dict(json.loads(json.dumps(f.to_dict()))).nvml_notes == f.nvml_notes
    cuda_torch = replace(f, frameworks=machine().frameworks)  # this machine's torch is CPU-only
    sel = simulate(cuda_torch, {"nccl": "ok"}, framework="torch")
    assert sel.backend == "nccl"  # no compute-capability rule fired on the unknown value
    notes = [e.topic for e in sel.plan.events if isinstance(e, Note)]
    assert "nvml_unread" in notes


@pytest.mark.gpu
@pytest.mark.torch
def test_real_nvml_sees_the_gpus_torch_sees() -> None:
    """On a GPU machine (RS_GPU_TESTS=1): the real NVML inspection, without importing torch,
    finds the GPUs torch finds, in CUDA's order, with their names and compute capabilities."""
    if os.environ.get("RS_GPU_TESTS") != "1":
        pytest.skip("set RS_GPU_TESTS=1 on a machine with CUDA GPUs")
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent("""
            import json, torch
            print(json.dumps([[torch.cuda.get_device_name(i),
                               list(torch.cuda.get_device_capability(i))]
                              for i in range(torch.cuda.device_count())]))
            """)], capture_output=True, text=True, timeout=deadline(180), check=False)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    f = detect_facts()
    assert [[g.name, list(g.compute_capability)] for g in f.gpus] == seen
    assert f.driver_version and not f.nvml_error
