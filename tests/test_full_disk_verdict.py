"""A full disk is never a verdict on the transport (issue 46, item 7): a probe that cannot write
its files is "unknown: no space" (a `NoSpaceError` naming the temp directory), never a fallback
to fewer processes nor a cached failure; a cache directory on a full disk is the logged degrade
docs/reference/errors.md promises.

On a real 16 KiB tmpfs mounted for the test (root and mount(8); skipped otherwise), as the
issue found it."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

from resilient_strategy.core.measures.probe import ERROR, OK, TIMEOUT, ProbeResult, ProbeSpec
from resilient_strategy.deciding.cache import DecisionCache
from resilient_strategy.errors import NoSpaceError

ROOT = Path(__file__).resolve().parents[1]
GLOO = "torch:gloo:cpu"


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 16 KiB tmpfs (root only), unmounted after."""
    target = tmp_path / "tiny"
    target.mkdir()
    mount = shutil.which("mount")
    if mount is None or not hasattr(os, "geteuid") or os.geteuid() != 0 or subprocess.run(
            [mount, "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(target)],
            capture_output=True, timeout=deadline(30)).returncode != 0:
        pytest.skip("a full filesystem needs root and mount(8) (tmpfs)")
    try:
        yield target
    finally:
        subprocess.run([shutil.which("umount") or "umount", "-l", str(target)],
                       capture_output=True, timeout=deadline(30))


def _fill(directory: Path, leave_pages: int = 0) -> None:
    """Fill ``directory``'s filesystem, then give ``leave_pages`` 4 KiB pages back."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        with pytest.raises(OSError) as exc:
            for _ in range(1 << 12):
                os.write(fd, b"\0" * 4096)
        assert exc.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
    os.truncate(filler, max(0, filler.stat().st_size - leave_pages * 4096))


def _decide(cache_dir: Path, env: dict[str, str], prober: Any) -> Any:
    from resilient_strategy.core.call.arguments import Arguments, options_from
    from resilient_strategy.deciding.decide import decide
    from resilient_strategy.testing.simulation import machine

    facts = machine(gpus=0, cpu_count=4)
    opts = options_from(facts, env, Arguments.from_kwargs(
        framework="torch", global_batch_size=32, cache=True, cache_dir=cache_dir))
    return facts, decide(facts, opts, env, prober, startup_check=True)


_TWO = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}


def _passes(spec: ProbeSpec, env: Any) -> ProbeResult:
    return ProbeResult(spec.candidate, OK, 1.0, bus_bandwidth_gbps=1.0, ranks=2)


# ----- the cache on a full disk: a logged degrade ----------------------------------------------
def test_a_cache_on_a_full_disk_is_a_logged_degrade(tiny_fs: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Before: `DecisionCache.store` raised the NoSpaceError of its atomic write (the issue's
    torchrun job ended rc 1 with 4 tracebacks)."""
    cache_dir = tiny_fs / "cache"
    cache_dir.mkdir(mode=0o700)
    _fill(tiny_fs)
    cache = DecisionCache(cache_dir)
    ok = ProbeResult(GLOO, OK, 1.0, bus_bandwidth_gbps=1.0, ranks=2)
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        assert cache.store("fp", {GLOO: ok}) is False
    assert [r.levelno for r in caplog.records if r.name == "resilient_strategy"] == \
        [logging.WARNING]
    assert cache.load("fp") == {}
    assert sorted(os.listdir(cache_dir)) == ["fp.lock"]  # no temporary file left behind


def test_a_decision_with_its_cache_on_a_full_disk_is_made(tiny_fs: Path) -> None:
    cache_dir = tiny_fs / "cache"
    cache_dir.mkdir(mode=0o700)
    _fill(tiny_fs)
    _, made = _decide(cache_dir, dict(_TWO), _passes)
    assert made.plan.chosen is not None and made.plan.chosen.key == GLOO


# ----- a full TMPDIR: no verdict, never a fallback ---------------------------------------------
@pytest.mark.parametrize("result", [
    ProbeResult(GLOO, TIMEOUT, 30.0, "timeout", "ranks [1] did not finish"),  # its files failed
    ProbeResult(GLOO, ERROR, 1.0, "no_space", "rank 0: [Errno 28] No space left on device"),
])
def test_a_probe_on_a_full_tmpdir_stops_the_decision_instead_of_halving_the_job(
        tiny_fs: Path, tmp_path: Path, result: ProbeResult) -> None:
    """Before: the probe's failure ruled gloo out ('its probe failed (no_space)') and the
    decision fell back to one CPU process instead of 2."""
    _fill(tiny_fs, leave_pages=2)
    calls: list[str] = []

    def prober(spec: ProbeSpec, env: Any) -> ProbeResult:
        calls.append(spec.candidate)
        return result

    cache_dir = tmp_path / "cache"
    with pytest.raises(NoSpaceError) as exc:
        _decide(cache_dir, {**_TWO, "TMPDIR": str(tiny_fs)}, prober)
    assert exc.value.path.startswith(str(tiny_fs))
    assert calls == [GLOO]  # nothing else was tried on the disk's account
    assert not cache_dir.exists() or not any(p.suffix == ".json" for p in cache_dir.iterdir())


def test_a_real_failure_with_room_in_tmpdir_still_falls_back(tmp_path: Path) -> None:
    def fails(spec: ProbeSpec, env: Any) -> ProbeResult:
        return ProbeResult(spec.candidate, ERROR, 1.0, "worker_error", "rank 0: boom")

    _, made = _decide(tmp_path / "cache", {**_TWO, "TMPDIR": str(tmp_path)}, fails)
    assert made.plan.chosen is not None and made.plan.chosen.key != GLOO


SCRIPT = r'''
import json, sys
import resilient_strategy
from resilient_strategy.errors import NoSpaceError
try:
    sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=32)
except NoSpaceError as exc:
    print(json.dumps({"error": type(exc).__name__, "path": exc.path}), flush=True)
    sys.exit(3)
print(json.dumps({"backend": sel.backend, "replicas": sel.num_replicas}), flush=True)
'''


@pytest.mark.slow
@pytest.mark.torch
def test_torchrun_with_a_full_tmpdir_never_halves_the_job(tiny_fs: Path, tmp_path: Path) -> None:
    """The issue's case end to end: a 2-process torchrun job with TMPDIR on a nearly full 16 KiB
    tmpfs. Before: rc 0 on one CPU process instead of 2 ('its probe failed (no_space)')."""
    pytest.importorskip("torch")
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this interpreter")
    _fill(tiny_fs, leave_pages=2)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tiny_fs), "CUDA_VISIBLE_DEVICES": "",
           "RESILIENT_STRATEGY_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("RESILIENT_STRATEGY_PROBE_FAULT", None)
    out = subprocess.run([str(torchrun), "--nproc-per-node", "2", str(script)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=deadline(300))
    said = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert said, out.stderr[-3000:]
    assert all(s.get("replicas") != 1 for s in said), out.stderr[-3000:]  # never halved
    assert {"error": "NoSpaceError"}.items() <= said[0].items(), out.stderr[-3000:]
    assert said[0]["path"].startswith(str(tiny_fs))
