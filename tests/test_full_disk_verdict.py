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
import math
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


# ----- the local ranks' agreement with its cache directory on a full disk ----------------------
_LAUNCH2 = {"TORCHELASTIC_RUN_ID": "job1", "MASTER_PORT": "29500", "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2"}
_PAYLOAD = {"chosen": GLOO, "results": {}, "from_cache": False, "proven": True}


def _two_ranks(cache_dir: Path, runtime: Path) -> tuple[Any, Any]:
    from resilient_strategy.nodes.onenode import Agreement

    env = {**_LAUNCH2, "XDG_RUNTIME_DIR": str(runtime)}
    return tuple(Agreement.for_job({**env, "LOCAL_RANK": str(r)}, "fp", cache_dir, ppid=1)
                 for r in (0, 1))  # type: ignore[return-value]


def _read_only(mount_point: Path) -> None:
    if subprocess.run([shutil.which("mount") or "mount", "-o", "remount,ro", str(mount_point)],
                      capture_output=True, timeout=deadline(30)).returncode != 0:
        pytest.skip("cannot remount the tmpfs read-only")


@pytest.mark.parametrize("disk", ["full", "read_only"])
def test_the_agreement_moves_to_the_private_directory_when_the_cache_disk_refuses_it(
        tiny_fs: Path, tmp_path: Path, disk: str, caplog: pytest.LogCaptureFixture) -> None:
    """Before: `Agreement.publish` let the NoSpaceError of the cache's disk out (rank 0 failed
    after deciding; rank 1 waited to its deadline)."""
    cache_dir = tiny_fs / "cache"
    cache_dir.mkdir(mode=0o700)
    _fill(tiny_fs)
    if disk == "read_only":
        _read_only(tiny_fs)
    runtime = tmp_path / "run"
    leader, follower = _two_ranks(cache_dir, runtime)
    assert leader.path.parent == cache_dir  # the cache directory itself passes every check
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        written = leader.publish(_PAYLOAD)
    assert written == leader.fallback == runtime / "resilient_strategy" / leader.path.name
    assert [r.levelno for r in caplog.records if r.name.startswith("resilient_strategy")] == \
        [logging.WARNING]  # said once
    assert follower.wait(5.0, not_before=-math.inf)["chosen"] == GLOO
    assert os.listdir(runtime / "resilient_strategy") == []  # the last reader cleaned up
    assert not any(p.name.startswith("agree-") for p in cache_dir.iterdir())


def test_a_follower_started_before_the_move_still_finds_the_decision(tiny_fs: Path,
                                                                     tmp_path: Path) -> None:
    """The waiting rank polls both places from the start, in another process: it finds the
    decision rank 0 could only write in the private directory."""
    cache_dir = tiny_fs / "cache"
    cache_dir.mkdir(mode=0o700)
    _fill(tiny_fs)
    runtime = tmp_path / "run"
    code = (
        "import json, math, sys\n"
        "from pathlib import Path\n"
        "from resilient_strategy.nodes.onenode import Agreement\n"
        f"env = {{**{_LAUNCH2!r}, 'XDG_RUNTIME_DIR': {str(runtime)!r}, 'LOCAL_RANK': '1'}}\n"
        f"ag = Agreement.for_job(env, 'fp', Path({str(cache_dir)!r}), ppid=1)\n"
        "print('waiting', flush=True)\n"
        "print(json.dumps(ag.wait(60.0, poll_s=0.05, not_before=-math.inf)), flush=True)\n")
    follower = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        assert follower.stdout is not None and follower.stdout.readline() == "waiting\n"
        leader, _ = _two_ranks(cache_dir, runtime)
        assert leader.publish(_PAYLOAD) == leader.fallback
        out, _ = follower.communicate(timeout=deadline(60))
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait(timeout=deadline(10))
    assert follower.returncode == 0
    assert json.loads(out)["chosen"] == GLOO


OTHER_UID = 65534  # nobody: the second real user (root's setuid), as tests/test_evidence_trust


def _as_other_user(action: Any) -> None:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            action()
            code = 0
        except BaseException as exc:
            os.write(2, f"as uid {OTHER_UID}: {exc!r}\n".encode())
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_private_directory_planted_by_another_user_is_never_the_fallback(
        tiny_fs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No XDG_RUNTIME_DIR: the fallback is ``<tempdir>/resilient_strategy-<uid>`` in a shared
    sticky directory, where a second real user made that name first (mode 0777). Rank 0 then
    refuses to publish there (one typed error, no NoSpaceError traceback) and the waiting rank
    never reads a file from it."""
    import tempfile

    from resilient_strategy.errors import ResilientStrategyError
    from resilient_strategy.nodes.onenode import Agreement, AgreementTimeoutError

    shared = Path(tempfile.mkdtemp(prefix="rs-test-agree-", dir="/tmp"))
    try:
        shared.chmod(0o1777)
        monkeypatch.setattr(tempfile, "tempdir", str(shared))
        squatted = shared / f"resilient_strategy-{os.getuid()}"
        planted = squatted / "planted.json"

        def plant() -> None:
            squatted.mkdir(mode=0o777)
            os.chmod(squatted, 0o777)

        _as_other_user(plant)
        assert squatted.stat().st_uid == OTHER_UID
        cache_dir = tiny_fs / "cache"
        cache_dir.mkdir(mode=0o700)
        _fill(tiny_fs)
        env = {**_LAUNCH2}
        leader, follower = (Agreement.for_job({**env, "LOCAL_RANK": str(r)}, "fp", cache_dir,
                                              ppid=1) for r in (0, 1))
        assert leader.fallback is not None and leader.fallback.parent == squatted
        _as_other_user(lambda: planted.parent.joinpath(leader.path.name).write_text(json.dumps(
            {**_PAYLOAD, "chosen": "cpu", "published_at": 1e12})))
        with pytest.raises(ResilientStrategyError, match=f"owned by uid {OTHER_UID}") as exc:
            leader.publish(_PAYLOAD)
        assert not isinstance(exc.value, NoSpaceError)
        with pytest.raises(AgreementTimeoutError):  # the planted "cpu" decision is never read
            follower.wait(0.3, poll_s=0.05, not_before=-math.inf)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


AGREE_SCRIPT = r'''
import json, logging, os
logging.basicConfig(level=logging.WARNING)
import resilient_strategy
sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=32)
notes = [e.topic for e in sel.plan.events if e.kind == "note" and e.topic == "agreement_moved"]
print(json.dumps({"rank": int(os.environ["LOCAL_RANK"]), "backend": sel.backend,
                  "replicas": sel.num_replicas, "notes": notes}), flush=True)
'''


@pytest.mark.slow
@pytest.mark.torch
def test_torchrun_with_its_cache_on_a_full_disk_still_agrees(tiny_fs: Path,
                                                            tmp_path: Path) -> None:
    """Issue 46, item 7: a 2-process torchrun job whose cache directory is on a full 16 KiB
    tmpfs. Before: local rank 0 decided, then its publish of the decision for local rank 1
    raised the NoSpaceError of the agreement file (rc 1, rank 1 waiting until its deadline).
    After: rank 0 publishes in this user's private runtime directory, which rank 1 also reads,
    and both train on the same decision; the degrade is a logged line and rank 0's trace note
    (``agreement_moved``)."""
    pytest.importorskip("torch")
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this interpreter")
    cache_dir = tiny_fs / "cache"
    cache_dir.mkdir(mode=0o700)
    _fill(tiny_fs)
    script = tmp_path / "train.py"
    script.write_text(AGREE_SCRIPT)
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", "XDG_RUNTIME_DIR": str(runtime),
           "RESILIENT_STRATEGY_CACHE_DIR": str(cache_dir)}
    env.pop("RESILIENT_STRATEGY_PROBE_FAULT", None)
    out = subprocess.run([str(torchrun), "--nproc-per-node", "2", str(script)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=deadline(300))
    said = sorted((json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")),
                  key=lambda s: s["rank"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert [s["rank"] for s in said] == [0, 1], out.stderr[-3000:]
    assert said[0]["backend"] == said[1]["backend"] and said[0]["replicas"] == 2
    assert said[0]["notes"] == ["agreement_moved"], out.stderr[-3000:]  # rank 0 published
    assert said[1]["notes"] == []
    assert not any(p.name.startswith("agree-") for p in cache_dir.iterdir())
    assert not any(p.name.startswith("agree-") for p in (runtime / "resilient_strategy").iterdir())


def test_the_local_ranks_gpus_are_shared_when_the_cache_disk_is_full(tiny_fs: Path,
                                                                    tmp_path: Path) -> None:
    """The GPUs each local rank sees go through the agreement's directory too: on a full cache
    disk each rank writes them in the private directory, and each reads every rank's there."""
    import concurrent.futures

    from resilient_strategy.nodes.onenode import GpuExchange

    cache_dir = tiny_fs / "cache"
    cache_dir.mkdir(mode=0o700)
    _fill(tiny_fs)
    env = {**_LAUNCH2, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    ranks = [GpuExchange.for_job(env, cache_dir, r, 2, ppid=1) for r in (0, 1)]
    assert ranks[0].directory == cache_dir and ranks[0].fallback == tmp_path / "run" / \
        "resilient_strategy"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        seen = list(pool.map(lambda r: ranks[r].share([{"index": r, "uuid": f"GPU-{r}"}], 10.0,
                                                      not_before=-math.inf), (0, 1)))
    assert seen[0] == seen[1] == [[{"index": 0, "uuid": "GPU-0"}], [{"index": 1, "uuid": "GPU-1"}]]
    assert os.listdir(tmp_path / "run" / "resilient_strategy") == []
