from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import deadline

from resilient_strategy.core.values.facts import FrameworkInfo
from resilient_strategy.machine import versions
from resilient_strategy.machine.versions import detect_frameworks

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=env, timeout=deadline(timeout), check=False,
    )


def _write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return str(path)


# ----- build files read with ast -------------------------------------------------------------
def test_tf_gpu_build_info_ordered_dict(tmp_path: Path) -> None:
    path = _write(tmp_path / "build_info.py", """\
        import collections
        build_info = collections.OrderedDict([('cpu_compiler', '/usr/bin/clang'),
            ('cuda_compute_capabilities', ['sm_60', 'sm_70', 'sm_80', 'sm_89', 'compute_90']),
            ('cuda_version', '12.5.1'), ('cudnn_version', '9'), ('is_cuda_build', True)])
        """)
    info = versions.build_info(path)
    assert info["cuda_version"] == "12.5.1"
    assert info["cuda_compute_capabilities"][-1] == "compute_90"


def test_tf_build_info_dict_literal_and_old_constants(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.py", "build_info = {'cuda_version': '11.2', 'nccl_version': '2'}")
    assert versions.build_info(path) == {"cuda_version": "11.2", "nccl_version": "2"}
    old = _write(tmp_path / "b.py", "is_cuda_build = True\ncuda_version_number = '10.1'\n")
    assert versions.build_info(old)["cuda_version_number"] == "10.1"


def test_literals_skip_code_and_survive_bad_files(tmp_path: Path) -> None:
    path = _write(tmp_path / "version.py", """\
        from typing import Optional
        __version__ = '2.7.1+cu128'
        cuda: Optional[str] = '12.8'
        hip: Optional[str] = None
        git_version = compute()
        """)
    assert versions.literals(path) == {"__version__": "2.7.1+cu128", "cuda": "12.8", "hip": None}
    assert versions.literals(_write(tmp_path / "bad.py", "x = (\n")) == {}
    assert versions.literals(str(tmp_path / "missing.py")) == {}


class Packages:
    """A metadata source (versions.MetadataSource) describing installed packages."""

    def __init__(self, dists: dict[str, Any] | None = None, installed: dict[str, str] | None = None,
                 dirs: dict[str, str] | None = None) -> None:
        self.dists, self.installed, self.dirs = dists or {}, installed or {}, dirs or {}

    def distribution(self, name: str) -> Any:
        if name in self.dists:
            return self.dists[name]
        raise importlib.metadata.PackageNotFoundError(name)

    def version(self, name: str) -> str:
        if name in self.installed:
            return self.installed[name]
        raise importlib.metadata.PackageNotFoundError(name)

    def package_dir(self, name: str) -> str | None:
        return self.dirs.get(name)


def _cuda_build(tmp_path: Path, framework: str) -> str:
    """A package folder whose generated build file says it is a CUDA build."""
    folder = tmp_path / framework
    if framework == "torch":
        _write(folder / "version.py", "__version__ = '2.7.1+cu128'\ncuda = '12.8'\n")
    else:
        _write(folder / "python" / "platform" / "build_info.py",
               "build_info = {'cuda_version': '12.3'}\n")
    return str(folder)


def _nccl_of(tmp_path: Path, requires: Any, installed: dict[str, str], tensorflow: bool) -> Any:
    """The NCCL that detect_frameworks reports for a CUDA torch (no extras) or a CUDA
    TensorFlow (its "and-cuda" extra) whose distribution ``requires`` these."""
    fw = "tensorflow" if tensorflow else "torch"
    packages = Packages(dists={fw: SimpleNamespace(version="1.0", requires=requires)},
                        installed=installed, dirs={fw: _cuda_build(tmp_path, fw)})
    return detect_frameworks({}, packages)[1 if tensorflow else 0].nccl


def test_required_nccl_reads_the_pinned_wheel(tmp_path: Path) -> None:
    requires = ["filelock", 'nvidia-nccl-cu12==2.26.2; platform_system == "Linux"', "sympy>=1.13"]
    pinned = _nccl_of(tmp_path, requires, {"nvidia-nccl-cu12": "2.26.2"}, tensorflow=False)
    assert pinned == ("2.26.2" if sys.platform.startswith("linux") else None)
    assert _nccl_of(tmp_path, None, {"nvidia-nccl-cu12": "2.26.2"}, tensorflow=False) is None


# TensorFlow 2.17's own requirement: the NCCL wheel comes only with the "and-cuda" extra.
_TF_REQUIRES = [
    "absl-py>=1.0.0",
    'nvidia-cublas-cu12==12.3.4.1; extra == "and-cuda"',
    'nvidia-nccl-cu12==2.21.5; extra == "and-cuda"',
]


@pytest.mark.parametrize(
    ("requires", "installed", "extras", "nccl"),
    [
        # torch's nvidia-nccl-cu12 2.26.2 is installed, not the 2.21.5 TF pins: not TF's NCCL
        (_TF_REQUIRES, {"nvidia-nccl-cu12": "2.26.2"}, ("and-cuda",), None),
        (_TF_REQUIRES, {"nvidia-nccl-cu12": "2.21.5"}, ("and-cuda",), "2.21.5"),
        # without the extra the requirement does not apply at all
        (_TF_REQUIRES, {"nvidia-nccl-cu12": "2.21.5"}, (), None),
        (['nvidia-nccl-cu12==2.21.5; extra == "other"'], {"nvidia-nccl-cu12": "2.21.5"},
         ("and-cuda",), None),
        # markers on the platform are evaluated for this one
        (['nvidia-nccl-cu12>=2.20; extra == "and-cuda" and python_version < "3"'],
         {"nvidia-nccl-cu12": "2.21.5"}, ("and-cuda",), None),
        (["nvidia-nccl-cu12>=2.20"], {"nvidia-nccl-cu12": "2.21.5"}, (), "2.21.5"),
        (["NVIDIA_NCCL_CU12 >=2.20"], {"nvidia-nccl-cu12": "2.21.5"}, (), "2.21.5"),
        # a requirement that cannot be parsed, or a package that is not installed: unknown
        (["nvidia-nccl-cu12 ===="], {"nvidia-nccl-cu12": "2.21.5"}, (), None),
        (_TF_REQUIRES, {}, ("and-cuda",), None),
    ],
)
def test_required_nccl_only_reports_the_wheel_the_requirement_accepts(
    tmp_path: Path,
    requires: list[str],
    installed: dict[str, str],
    extras: tuple[str, ...],
    nccl: str | None,
) -> None:
    # TensorFlow is read with its "and-cuda" extra, torch with none
    assert _nccl_of(tmp_path, requires, installed, tensorflow=bool(extras)) == nccl


# ----- installed frameworks ----------------------------------------------------------------
def test_installed_cpu_builds_of_this_venv() -> None:
    fws = {f.name: f for f in detect_frameworks({})}
    assert list(fws) == ["torch", "tensorflow", "keras"]
    if importlib.util.find_spec("torch"):
        torch = fws["torch"]
        assert torch.version == importlib.metadata.version("torch")
        assert torch.distribution == "torch"
        if "+cpu" in (torch.version or ""):
            assert torch.cuda is None and torch.nccl is None
    tf = fws["tensorflow"]
    if tf.installed:
        assert tf.distribution in versions.DISTRIBUTIONS["tensorflow"]
        if tf.distribution == "tensorflow-cpu":
            assert tf.cuda is None and tf.archs == ()
    assert not any(f.imported or f.gpu_initialized for f in fws.values())


def test_not_installed_framework() -> None:
    assert detect_frameworks({}, Packages()) == (
        FrameworkInfo(name="torch"), FrameworkInfo(name="tensorflow"), FrameworkInfo(name="keras"))
    keras = Packages(dists={"keras-nightly": SimpleNamespace(version="3.9.0.dev1", requires=[])})
    assert detect_frameworks({"keras": object()}, keras)[2] == FrameworkInfo(
        name="keras", version="3.9.0.dev1", distribution="keras-nightly", imported=True)


#: Every framework installed (version 1.0), whatever this machine has: the tests of imported and
#: initialized state must not depend on TensorFlow or Keras being here.
ALL_INSTALLED = Packages(dists={n: SimpleNamespace(version="1.0", requires=[])
                                for n in ("torch", "tensorflow", "keras")})


def test_imported_and_initialized_from_modules() -> None:
    torch = SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: True))
    ctx = SimpleNamespace(_physical_devices=["/physical_device:CPU:0"], _context_handle=None)
    mods = {
        "torch": torch,
        "tensorflow": object(),
        "tensorflow.python.eager.context": SimpleNamespace(context_safe=lambda: ctx),
        "keras": object(),
    }
    fws = {f.name: f for f in detect_frameworks(mods, ALL_INSTALLED)}
    assert fws["torch"].imported and fws["torch"].gpu_initialized
    assert fws["tensorflow"].imported and fws["tensorflow"].gpu_initialized
    assert fws["keras"].imported and not fws["keras"].gpu_initialized


def test_initialized_checks_never_raise_on_odd_internals() -> None:
    def boom() -> bool:
        raise RuntimeError("internals changed")

    assert not versions.torch_initialized({"torch": SimpleNamespace(cuda=SimpleNamespace(
        is_initialized=boom))})
    assert not versions.torch_initialized({"torch": object()})
    no_ctx = SimpleNamespace(context_safe=lambda: None)
    assert not versions.tensorflow_initialized({"tensorflow.python.eager.context": no_ctx})
    fresh = SimpleNamespace(context_safe=lambda: SimpleNamespace(_physical_devices=None))
    assert not versions.tensorflow_initialized({"tensorflow.python.eager.context": fresh})
    odd = SimpleNamespace(context_safe=boom)
    assert not versions.tensorflow_initialized({"tensorflow.python.eager.context": odd})


def test_detect_frameworks_imports_no_framework_and_is_fast() -> None:
    out = _python("""
        import sys, time, json
        from resilient_strategy.machine.versions import detect_frameworks
        t = time.perf_counter(); detect_frameworks(); first = time.perf_counter() - t
        t = time.perf_counter(); detect_frameworks(); again = time.perf_counter() - t
        heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorflow', 'keras')]
        print(json.dumps([heavy, first, again]))
        """, timeout=60)
    assert out.returncode == 0, out.stderr
    heavy, first, again = json.loads(out.stdout)
    assert heavy == []
    assert first < 0.5 and again < 0.1  # measured ~13 ms / ~8 ms on a 2-core VM


@pytest.mark.slow
def test_real_tensorflow_initialized_state() -> None:
    if not importlib.util.find_spec("tensorflow"):
        pytest.skip("tensorflow not installed")
    out = _python("""
        import json
        from resilient_strategy.machine.versions import detect_frameworks
        def state():
            tf_info = detect_frameworks()[1]
            return [tf_info.imported, tf_info.gpu_initialized]
        seen = [state()]
        import tensorflow as tf
        seen.append(state())
        tf.config.list_physical_devices()
        seen.append(state())
        print(json.dumps(seen))
        """, timeout=180)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [
        [False, False], [True, False], [True, True]
    ]


@pytest.mark.slow
def test_real_torch_imported_but_not_initialized() -> None:
    if not importlib.util.find_spec("torch"):
        pytest.skip("torch not installed")
    out = _python("""
        import json, torch
        from resilient_strategy.machine.versions import detect_frameworks
        t = detect_frameworks()[0]
        # the distribution's version ("2.11.0" from PyPI) may lack torch.__version__'s local
        # part ("2.11.0+cu130"): the public parts agree
        print(json.dumps([t.imported, t.gpu_initialized,
                          t.version.split("+")[0] == torch.__version__.split("+")[0]]))
        """, timeout=180)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, False, True]
