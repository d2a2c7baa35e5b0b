"""Markers that need a framework skip cleanly where it is not installed (a GPU workstation with
torch only, a TensorFlow-only box): ``@pytest.mark.torch`` / ``@pytest.mark.tensorflow``.
Installed means importable: ``importlib.util.find_spec`` finds it (it imports nothing)."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from collections.abc import Iterator

import pytest

_NEEDS = {"torch": "torch", "tensorflow": "tensorflow"}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


#: The fixtures that start the network-namespace test bed: their tests are marked `bed` and run
#: as their own step of .ci/run (`python -m pytest -m bed`), outside the main command's budget.
BED_FIXTURES = frozenset({"bed", "bed3", "quiet_run"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        uses = set(getattr(item, "fixturenames", ()))
        if item.path.name == "test_testbed.py" and (
                uses & BED_FIXTURES or "sweeps_what_an_earlier_bed_left" in item.name):
            item.add_marker(pytest.mark.bed)


def pytest_runtest_setup(item: pytest.Item) -> None:
    for marker, module in _NEEDS.items():
        if item.get_closest_marker(marker) is not None and not _installed(module):
            pytest.skip(f"{module} is not installed")


@pytest.fixture(autouse=True)
def _gpus_only_where_marked(request: pytest.FixtureRequest,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A test describes a machine without GPUs unless it is marked ``gpu``: on a GPU machine
    its GPUs are hidden from it (``CUDA_VISIBLE_DEVICES=""``, which this package and every
    process the test starts read as "no GPU"), so the suite asserts the same decisions on a
    laptop, in CI and on a GPU server. Tests marked ``gpu`` see the machine as it is."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(autouse=True, scope="session")
def _session_tempdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What the package puts in the temp directory while the suite runs (the agreement files of
    simulated launches, whose other ranks never come to read them; probe directories) goes to a
    directory of this session, removed at its end: never into /tmp/resilient_strategy-<uid>."""
    old = tempfile.tempdir
    here = tmp_path_factory.mktemp("tempdir")
    tempfile.tempdir = str(here)
    try:
        yield
    finally:
        tempfile.tempdir = old
        shutil.rmtree(here, ignore_errors=True)
