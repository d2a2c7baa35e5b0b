"""Checkpoints that cannot hurt (issue 22.4): the cache's rules for the directory and the file,
a damaged checkpoint a typed error naming it (never advising weights_only=False), and the
previous good checkpoint loaded when the latest is damaged."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from resilient_strategy.errors import CheckpointError, UnsafePathError

torch = pytest.importorskip("torch")

from resilient_strategy.frameworks.checkpoint import Checkpointer  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def _ckpt(directory: Path) -> tuple[Checkpointer, Any]:
    ckpt = Checkpointer(directory, every_steps=1)
    model = torch.nn.Linear(2, 1)
    ckpt.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), None, None, 4)
    return ckpt, model


def _saved(directory: Path, steps: int) -> Checkpointer:
    ckpt, _ = _ckpt(directory)
    for _ in range(steps):
        ckpt.micro_step(boundary=True, stepped=True)  # saves at every step
    ckpt.wait()  # the last write ends (asynchronous saves) before the test looks at the files
    return ckpt


def _restored(directory: Path) -> Checkpointer:
    ckpt, _ = _ckpt(directory)
    return ckpt


def test_each_save_keeps_the_previous_one(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    ckpt = _saved(d, 3)
    assert ckpt.path.exists() and ckpt.previous_path.exists()
    assert _restored(d).restored_step == 3
    assert oct(d.stat().st_mode & 0o777) == oct(0o700)  # created private


@pytest.mark.parametrize("damage", ["garbage", "truncated", "a_pickled_object", "not_a_dict"])
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, damage: str) -> None:
    d = tmp_path / "ckpt"
    ckpt = _saved(d, 3)
    _damage(ckpt.path, damage)
    back = _restored(d)
    assert back.restored_step == 2  # the previous good one
    assert ckpt.path.with_suffix(".corrupt").exists()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "a_pickled_object", "not_a_dict"])
def test_a_damaged_checkpoint_without_a_previous_one_is_a_typed_error(
        tmp_path: Path, damage: str) -> None:
    d = tmp_path / "ckpt"
    ckpt = _saved(d, 1)
    ckpt.previous_path.unlink(missing_ok=True)
    _damage(ckpt.path, damage)
    with pytest.raises(CheckpointError) as exc:
        _restored(d)
    assert exc.value.path == str(ckpt.path)
    assert "weights_only=False" not in str(exc.value)


def _damage(path: Path, how: str) -> None:
    if how == "garbage":
        path.write_bytes(b"\x00not a checkpoint" * 10)
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    elif how == "a_pickled_object":  # refused by weights_only=True: never loaded as code
        with path.open("wb") as fh:
            pickle.dump(Path("/"), fh)
    else:
        torch.save([1, 2, 3], path)


def test_a_checkpoint_reached_through_a_symlink_is_refused(tmp_path: Path) -> None:
    good = _saved(tmp_path / "elsewhere", 1)
    d = tmp_path / "ckpt"
    d.mkdir(mode=0o700)
    (d / "checkpoint.pt").symlink_to(good.path)
    with pytest.raises(UnsafePathError):
        _restored(d)


def test_a_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    _saved(d, 1)
    d.chmod(0o777)
    with pytest.raises(UnsafePathError):
        _restored(d)
    with pytest.raises(UnsafePathError):
        _saved(d, 1)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="giving a file to another user needs root")
def test_a_checkpoint_of_another_user_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    ckpt = _saved(d, 1)
    os.chown(ckpt.path, 65534, 65534)
    with pytest.raises(UnsafePathError):
        _restored(d)
