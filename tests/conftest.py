"""Markers that need a framework skip cleanly where it is not installed (a GPU workstation with
torch only, a TensorFlow-only box): ``@pytest.mark.torch`` / ``@pytest.mark.tensorflow``.
Installed means importable: ``importlib.util.find_spec`` finds it (it imports nothing).

Two helpers every test module may import (``from conftest import deadline, children_of``):
`deadline` scales a subprocess's deadline to the machine (a loaded 2-core CI runner is several
times slower than the machine a deadline was first set on: a deadline only bounds a hang, it is
never what a test asserts), and `children_of` reads ``/proc`` where processes come and go while
it is read (one that exits between the listing and the read is simply absent)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator

import pytest

_NEEDS = {"torch": "torch", "tensorflow": "tensorflow"}

#: Sets the factor of `deadline` (a number >= 1), instead of the one derived from the machine.
SCALE_VAR = "RS_TEST_TIMEOUT_SCALE"
#: The factor's bounds: a deadline only bounds a hang, so a generous one costs nothing on a pass.
MAX_SCALE = 10.0
#: The cores the suite's deadlines were set on; a machine with fewer is slower by their ratio.
REFERENCE_CPUS = 4


def timeout_scale(env: dict[str, str] | None = None, cpus: int | None = None,
                  load: float | None = None) -> float:
    """The factor `deadline` applies: ``RS_TEST_TIMEOUT_SCALE`` where set (at least 1), else
    the larger of the machine's shortfall in cores (`REFERENCE_CPUS` / its cores) and its load
    (1 + runnable processes per core over the last minute, ``os.getloadavg``), within 1 and
    `MAX_SCALE`. Arguments replace what is read (for its tests)."""
    env = dict(os.environ) if env is None else env
    if env.get(SCALE_VAR):
        try:
            return min(max(float(env[SCALE_VAR]), 1.0), 100.0)
        except ValueError:
            pass
    cpus = (os.cpu_count() or 1) if cpus is None else cpus
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = 0.0
    cpus = max(cpus, 1)
    return min(max(REFERENCE_CPUS / cpus, 1.0 + max(load, 0.0) / cpus, 1.0), MAX_SCALE)


def deadline(seconds: float) -> float:
    """``seconds`` scaled to this machine now (`timeout_scale`): the deadline of a subprocess a
    test starts (``subprocess.run(..., timeout=deadline(120))``)."""
    return seconds * timeout_scale()


def children_of(ppid: int, root: str = "/proc", listing: Iterable[str] | None = None) -> list[int]:
    """The processes whose parent is ``ppid`` (zombies included), sorted. ``listing`` replaces
    ``os.listdir(root)`` (for its tests); a process listed that has exited before its ``stat`` is
    read is not one of them, never an error."""
    try:
        names = os.listdir(root) if listing is None else list(listing)
    except OSError:
        return []
    found = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"{root}/{name}/stat", encoding="ascii", errors="replace") as fh:
                fields = fh.read().rpartition(")")[2].split()
        except OSError:  # gone since the listing (FileNotFoundError, ProcessLookupError: ESRCH)
            continue
        if len(fields) > 1 and fields[1] == str(ppid):
            found.append(int(name))
    return sorted(found)


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
def _no_measured_switch_in_shared_fixtures() -> Iterator[None]:
    """The same for module- and session-scoped fixtures (a module's reference run starts
    before any function-scoped fixture): set for the whole session, restored after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RESILIENT_STRATEGY_MEASURED_SWITCH", "0")
        yield


@pytest.fixture(autouse=True)
def _no_measured_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test's ``resilient-strategy run`` acts on no measured "another candidate is
    clearly faster" (``RESILIENT_STRATEGY_MEASURED_SWITCH=0``): on a small CPU machine the toy
    scripts of the real-run tests measure one process faster than gloo on two, and a switch
    mid-run would change the attempts they assert on. The tests of the switch itself
    (tests/test_measured_switch.py) set it to 1."""
    monkeypatch.setenv("RESILIENT_STRATEGY_MEASURED_SWITCH", "0")


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
