"""Checkpoints you can trust (issue 36): every checkpoint path under the rules of
machine/files.py, no pickle from a path that is not provably this user's, and a damaged newest
sharded step falls back to the previous one.

The hostile variants are planted as a second real user: when the tests run as root (CI), each
planted path is chown-ed to uid 65534 (nobody), which is what another user's file is to the
loader; without root a second user cannot be had, and those tests skip saying so."""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

torch = pytest.importorskip("torch")

from resilient_strategy.errors import CheckpointError, UnsafePathError  # noqa: E402
from resilient_strategy.frameworks import sharded_checkpoint as sc  # noqa: E402
from resilient_strategy.frameworks.checkpoint import Checkpointer  # noqa: E402

pytestmark = [pytest.mark.torch]

OTHER_UID = 65534  # nobody
as_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="planting a second real user's files needs root (chown); CI runs these as root")


def _model() -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _save(directory: Path, *steps: int) -> Any:
    """Sharded checkpoints at ``steps`` (a plain module through DCP, no process group); the
    model's weights differ per step so that the one loaded can be told apart."""
    model, opt = _model()
    for k in steps:
        with torch.no_grad():
            model.weight.fill_(float(k))
        sc.save(directory, model, opt, _meta(k), 0)
    return model


def _meta(k: int) -> dict[str, Any]:
    return {"version": 1, "model": None, "optimizer": None, "scaler": None, "epoch": 0,
            "samples_in_epoch": 0, "optimizer_steps": k, "world_size": 1,
            "rng": {"torch": torch.get_rng_state()}}


def _step(directory: Path, k: int) -> Path:
    return directory / "sharded" / f"step-{k:09d}"


def _chown_tree(path: Path, uid: int = OTHER_UID) -> None:
    os.chown(path, uid, uid, follow_symlinks=False)
    if path.is_dir() and not path.is_symlink():
        for child in path.rglob("*"):
            os.chown(child, uid, uid, follow_symlinks=False)


class _Payload:
    """What a hostile pickle runs when loaded: makes ``marker`` (a directory)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def _restore(directory: Path) -> tuple[Checkpointer, Any]:
    model, opt = _model()
    ckpt = Checkpointer(directory, every_steps=1)
    ckpt.attach(model, opt, None, None, 1)  # attach() restores
    return ckpt, model


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text
    return text


# ----- created private -------------------------------------------------------------------------
def test_every_path_of_a_sharded_checkpoint_is_created_private(tmp_path: Path) -> None:
    old = os.umask(0o022)  # a usual umask: DCP's files would be 0644 under it
    try:
        _save(tmp_path / "ckpt", 3)
    finally:
        os.umask(old)
    modes = {str(p.relative_to(tmp_path)): p.stat().st_mode & 0o777
             for p in [tmp_path / "ckpt", *(tmp_path / "ckpt").rglob("*")]}
    assert {m for p, m in modes.items() if (tmp_path / p).is_dir()} == {0o700}
    assert {m for p, m in modes.items() if not (tmp_path / p).is_dir()} == {0o600}
    assert {Path(p).name for p in modes} >= {".metadata", "meta.pt", "latest", "__0_0.distcp"}


# ----- hostile variants, as a second real user ------------------------------------------------
@as_root
def test_another_users_checkpoint_directory_is_refused_before_anything_is_read(
        tmp_path: Path) -> None:
    directory = tmp_path / "shared"
    _save(directory, 4)
    _chown_tree(directory)
    with pytest.raises(UnsafePathError) as exc:
        _restore(directory)
    assert exc.value.path == str(directory)
    _one_line(exc.value)


@as_root
def test_another_users_sharded_dir_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    _save(directory, 4)
    _chown_tree(directory / "sharded")
    with pytest.raises(UnsafePathError) as exc:
        _restore(directory)
    assert exc.value.path == str(directory / "sharded")


@as_root
def test_metadata_planted_by_another_user_is_never_unpickled(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    _save(directory, 4)
    marker = tmp_path / "payload-ran"
    metadata = _step(directory, 4) / ".metadata"
    metadata.write_bytes(pickle.dumps(_Payload(marker)))
    os.chown(metadata, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePathError) as exc:
        _restore(directory)
    assert exc.value.path == str(metadata)
    assert not marker.exists()
    _one_line(exc.value)


def test_a_hostile_metadata_of_this_users_own_builds_nothing(tmp_path: Path,
                                                             caplog: Any) -> None:
    """Even a file of this user's: the metadata reader builds DCP's classes only."""
    directory = tmp_path / "ckpt"
    _save(directory, 4)
    marker = tmp_path / "payload-ran"
    metadata = _step(directory, 4) / ".metadata"
    metadata.write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError) as exc:
        _restore(directory)
    assert exc.value.path == str(_step(directory, 4))  # no older step to fall back to
    assert "UnpicklingError" in exc.value.problem
    assert not marker.exists()


@as_root
def test_a_symlinked_step_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    _save(elsewhere, 9)
    _chown_tree(elsewhere)
    directory = tmp_path / "ckpt"
    _save(directory, 4)
    link = _step(directory, 9)
    link.symlink_to(_step(elsewhere, 9))
    os.chown(link, OTHER_UID, OTHER_UID, follow_symlinks=False)
    with pytest.raises(UnsafePathError) as exc:
        _restore(directory)
    assert exc.value.path == str(link)


def test_a_symlinked_step_of_this_users_own_is_refused_too(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    _save(elsewhere, 9)
    directory = tmp_path / "ckpt"
    _save(directory, 4)
    link = _step(directory, 9)
    link.symlink_to(_step(elsewhere, 9))
    with pytest.raises(UnsafePathError) as exc:
        _restore(directory)
    assert exc.value.path == str(link)


@as_root
def test_a_fifo_pointer_is_refused_without_blocking(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    _save(directory, 4)
    pointer = directory / "sharded" / "latest"
    pointer.unlink()
    os.mkfifo(pointer, 0o600)
    os.chown(pointer, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePathError) as exc:
        _restore(directory)
    assert exc.value.path == str(pointer)


def test_a_fifo_pointer_of_this_users_own_is_refused_without_blocking(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    _save(directory, 4)
    pointer = directory / "sharded" / "latest"
    pointer.unlink()
    os.mkfifo(pointer, 0o600)
    with pytest.raises(UnsafePathError) as exc:
        _restore(directory)
    assert exc.value.path == str(pointer)


@as_root
def test_a_shard_of_another_users_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    _save(directory, 4)
    shard = _step(directory, 4) / "__0_0.distcp"
    os.chown(shard, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePathError) as exc:
        _restore(directory)
    assert exc.value.path == str(shard)


def test_a_group_writable_step_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    _save(directory, 4)
    os.chmod(_step(directory, 4), 0o770)
    with pytest.raises(UnsafePathError) as exc:
        _restore(directory)
    assert exc.value.path == str(_step(directory, 4))


@as_root
def test_a_sharded_save_never_writes_into_another_users_directory(tmp_path: Path) -> None:
    directory = tmp_path / "shared"
    directory.mkdir(mode=0o755)
    os.chown(directory, OTHER_UID, OTHER_UID)
    model, opt = _model()
    with pytest.raises(UnsafePathError) as exc:
        sc.save(directory, model, opt, _meta(1), 0)
    assert exc.value.path == str(directory)
    assert list(directory.iterdir()) == []


# ----- damage falls back -----------------------------------------------------------------------
def _loaded_step(directory: Path) -> tuple[int | None, float]:
    ckpt, model = _restore(directory)
    return ckpt.restored_step, float(model.weight[0, 0].item())


@pytest.mark.parametrize("damage", ["truncated_shard", "truncated_metadata", "garbage_meta",
                                    "missing_shard"])
def test_a_damaged_newest_step_falls_back_to_the_previous(tmp_path: Path, damage: str,
                                                          caplog: Any) -> None:
    directory = tmp_path / "ckpt"
    _save(directory, 5, 10)
    newest = _step(directory, 10)
    if damage == "truncated_shard":
        shard = newest / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:40])
    elif damage == "truncated_metadata":
        md = newest / ".metadata"
        md.write_bytes(md.read_bytes()[:60])
    elif damage == "garbage_meta":
        (newest / "meta.pt").write_bytes(b"not a torch file")
    else:
        (newest / "__0_0.distcp").unlink()
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        assert _loaded_step(directory) == (5, 5.0)
    warned = [r for r in caplog.records
              if r.name == "resilient_strategy" and str(newest) in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0].getMessage()
    assert not newest.exists() and (newest.parent / f"damaged-{newest.name}").is_dir()


def test_a_pointer_to_a_missing_step_uses_the_newest_complete_one(tmp_path: Path,
                                                                  caplog: Any) -> None:
    directory = tmp_path / "ckpt"
    _save(directory, 5, 10)
    pointer = directory / "sharded" / "latest"
    pointer.write_text("step-000000099")
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        assert _loaded_step(directory) == (10, 10.0)
    warned = [r for r in caplog.records
              if r.name == "resilient_strategy" and str(pointer) in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0].getMessage()


def test_a_new_checkpoint_never_hides_a_newer_good_one(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    _save(directory, 10, 20)
    _save(directory, 3)  # e.g. a job restarted from scratch into the same directory
    assert sorted(p.name for p in (directory / "sharded").glob("step-*")) == [
        "step-000000003", "step-000000010", "step-000000020"]
    assert _loaded_step(directory) == (20, 20.0)


def test_damaged_with_nothing_to_fall_back_to_is_one_typed_line(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    _save(directory, 5)
    (_step(directory, 5) / "meta.pt").write_bytes(b"")
    with pytest.raises(CheckpointError) as exc:
        _restore(directory)
    assert exc.value.path == str(_step(directory, 5) / "meta.pt") or \
        exc.value.path == str(_step(directory, 5))
    _one_line(exc.value)


def test_keeps_the_newest_two_steps(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    _save(directory, 1, 2, 3, 4)
    assert sorted(p.name for p in (directory / "sharded").glob("step-*")) == [
        "step-000000003", "step-000000004"]


# ----- end to end: the example script under python, torchrun and `run` -------------------------
ROOT = Path(__file__).resolve().parents[1]


def _plant_hostile(directory: Path, marker: Path, kind: str) -> None:
    """Another user's checkpoint directory (mode 0755, uid 65534) holding a sharded step whose
    ``.metadata`` runs code when unpickled, or a plain ``checkpoint.pt`` that does."""
    if kind == "sharded":
        _save(directory, 56)
        (_step(directory, 56) / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    else:
        directory.mkdir()
        (directory / "checkpoint.pt").write_bytes(pickle.dumps(_Payload(marker)))
    for p in [directory, *directory.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    _chown_tree(directory)


def _launch(how: str, tmp: Path, checkpoint_dir: Path) -> Any:
    import subprocess
    import sys

    script = [str(ROOT / "examples" / "torch_train.py"), "--samples", "64", "--epochs", "1",
              "--global-batch-size", "32", "--hidden", "8", "--checkpoint-dir",
              str(checkpoint_dir)]
    launcher = {
        "python": [sys.executable],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", "1"],
        "run": [sys.executable, "-m", "resilient_strategy", "run", "--nproc-per-node", "1",
                "--evidence-dir", str(tmp / "evidence")],
    }[how]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "RESILIENT_STRATEGY_CACHE_DIR": str(tmp / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([*launcher, *script], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=deadline(300))


@as_root
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sharded", "plain"])
@pytest.mark.parametrize("how", ["python", "torchrun", "run"])
def test_a_planted_checkpoint_is_refused_under_every_launcher(tmp_path: Path, how: str,
                                                              kind: str) -> None:
    """The issue's attack: another user's shared directory with a planted ``.metadata`` (or a
    planted plain checkpoint). The job stops with the one-line UnsafePathError naming the
    directory; the payload never ran and nothing was written into the other user's
    directory."""
    directory, marker = tmp_path / "shared", tmp_path / "payload-ran"
    _plant_hostile(directory, marker, kind)
    before = sorted(str(p) for p in directory.rglob("*"))
    out = _launch(how, tmp_path, directory)
    assert out.returncode != 0
    assert not marker.exists()
    assert sorted(str(p) for p in directory.rglob("*")) == before
    refusals = [line for line in out.stderr.splitlines()
                if "UnsafePathError" in line and f"{directory}:" in line]
    assert refusals, out.stderr[-3000:]
