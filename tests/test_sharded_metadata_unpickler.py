"""DCP's ``.metadata`` read on every supported Python, and nothing else (issue 46, item 4).

The allow-list unpickler of `sharded_checkpoint` loads what the supported Python patch releases
write for the same metadata (3.11.2, Debian 12's, pickles an enum member as ``getattr(cls, name)``,
3.13 writes pathlib's classes as ``pathlib._local``'s), sets the state only of the instances it
made (never of a class or of an enum member the whole process shares), and refuses a file that
builds more than its size says (a few MB of references to one chunk) before DCP plans a load
from it. The streams are crafted with pickle's own opcodes, or written by pickle itself with
the reduce a given release uses."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.distributed.checkpoint import metadata as dcp_md  # noqa: E402
from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402

from resilient_strategy.errors import CheckpointError  # noqa: E402
from resilient_strategy.frameworks import sharded_checkpoint as sc  # noqa: E402
from resilient_strategy.frameworks.checkpoint import Checkpointer  # noqa: E402

pytestmark = [pytest.mark.torch]

MD = "torch.distributed.checkpoint.metadata"


def _model() -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _meta(k: int) -> dict[str, Any]:
    return {"version": 1, "model": None, "optimizer": None, "scaler": None, "epoch": 0,
            "samples_in_epoch": 0, "optimizer_steps": k, "world_size": 1,
            "rng": {"torch": torch.get_rng_state()}}


def _save(directory: Path, k: int) -> Path:
    model, opt = _model()
    with torch.no_grad():
        model.weight.fill_(float(k))
    sc.save(directory, model, opt, _meta(k), 0)
    return directory / "sharded" / f"step-{k:09d}"


def _load(raw: bytes) -> Any:
    return sc._MetadataUnpickler(io.BytesIO(raw), sc._entry_budget(len(raw))).load()


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _text(value: str) -> bytes:
    data = value.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data


def _stream(*parts: bytes) -> bytes:
    return pickle.PROTO + b"\x04" + b"".join(parts) + pickle.STOP


def _metadata(tensors: int, chunks: int) -> Any:
    """A DCP Metadata as FSDP2 writes it: each tensor sharded on dim 0 into ``chunks`` chunks,
    one a shard file."""
    state, storage = {}, {}
    for t in range(tensors):
        fqn = f"model.layers.{t}.weight"
        pieces = []
        for c in range(chunks):
            offset = torch.Size([c * 4, 0])
            pieces.append(dcp_md.ChunkStorageMetadata(offsets=offset, sizes=torch.Size([4, 8])))
            storage[dcp_md.MetadataIndex(fqn, offset, c)] = _StorageInfo(f"__{c}_0.distcp",
                                                                         t * 128, 128)
        state[fqn] = dcp_md.TensorStorageMetadata(
            dcp_md.TensorProperties(dtype=torch.bfloat16), torch.Size([chunks * 4, 8]), pieces)
    return dcp_md.Metadata(state, storage_data=storage,
                           storage_meta=dcp_md.StorageMeta(checkpoint_id=Path("/ckpt/step")),
                           version="1.0.0")


@pytest.fixture
def enum_by_getattr(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pickle writes enum members as Python 3.11.2 does (``Enum.__reduce_ex__`` of
    3.11.2: ``getattr, (self.__class__, self._name_)``; the same opcodes, checked)."""
    monkeypatch.setattr(dcp_md._MEM_FORMAT_ENCODING, "__reduce_ex__",
                        lambda self, proto: (getattr, (type(self), self._name_)))


# ----- what supported Pythons write loads --------------------------------------------------------
def test_a_checkpoint_written_with_enum_members_by_getattr_resumes(
        tmp_path: Path, enum_by_getattr: None) -> None:
    step = _save(tmp_path / "ckpt", 7)
    assert b"getattr" in (step / ".metadata").read_bytes()  # as 3.11.2 writes it
    model, opt = _model()
    Checkpointer(tmp_path / "ckpt", every_steps=1).attach(model, opt, None, None, 1)
    assert torch.equal(model.weight, torch.full((2, 3), 7.0))


def test_an_enum_member_by_value_loads_as_that_member() -> None:
    """3.10, later 3.11 releases (3.11.7 checked) and 3.12+ write ``cls(value)``."""
    member = _load(_stream(_global(MD, "_MEM_FORMAT_ENCODING"), pickle.BININT1 + b"\x01",
                           pickle.TUPLE1, pickle.REDUCE))
    assert member is dcp_md._MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST


@pytest.mark.parametrize("module", ["pathlib", "pathlib._local"])
def test_a_path_as_313_and_older_write_it_loads(module: str) -> None:
    path = _load(_stream(_global(module, "PosixPath"), _text("/ckpt/step"), pickle.TUPLE1,
                         pickle.REDUCE))
    assert path == Path("/ckpt/step")


def test_a_many_chunk_metadata_reads_as_pickle_reads_it() -> None:
    metadata = _metadata(tensors=40, chunks=16)
    assert _load(pickle.dumps(metadata)) == metadata


# ----- getattr: a member of an allowed enum, nothing else -----------------------------------------
@pytest.mark.parametrize("target, name", [
    (_global(MD, "_MEM_FORMAT_ENCODING"), "__class__"),
    (_global(MD, "_MEM_FORMAT_ENCODING"), "_missing_"),
    (_global(MD, "Metadata"), "__init__"),
    (_global("torch", "float32"), "__class__"),
    (_text("a str"), "join"),
])
def test_getattr_of_anything_but_an_allowed_enums_member_is_refused(target: bytes,
                                                                    name: str) -> None:
    with pytest.raises(pickle.UnpicklingError):
        _load(_stream(_global("builtins", "getattr"), target, _text(name), pickle.TUPLE2,
                      pickle.REDUCE))


# ----- BUILD: only onto an instance this load made ------------------------------------------------
def test_build_onto_an_allowed_class_is_refused_and_the_class_is_unchanged() -> None:
    before = dict(vars(dcp_md.Metadata))
    raw = _stream(_global(MD, "Metadata"), pickle.NONE, pickle.EMPTY_DICT,
                  _text("version"), _text("planted"), pickle.SETITEM, pickle.TUPLE2,
                  pickle.BUILD)
    try:
        with pytest.raises(pickle.UnpicklingError):
            _load(raw)
        assert dict(vars(dcp_md.Metadata)) == before
    finally:  # the code before the fix set it: leave the class as it was for later tests
        dcp_md.Metadata.version = before["version"]  # type: ignore[misc]


@pytest.mark.parametrize("slots", [False, True])
def test_build_onto_an_enum_member_is_refused_and_the_member_is_unchanged(slots: bool) -> None:
    member = dcp_md._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    state = pickle.EMPTY_DICT + _text("planted") + pickle.NEWTRUE + pickle.SETITEM
    raw = _stream(_global(MD, "_MEM_FORMAT_ENCODING"), pickle.BININT1 + b"\x00", pickle.TUPLE1,
                  pickle.REDUCE, *((pickle.NONE, state, pickle.TUPLE2) if slots else (state,)),
                  pickle.BUILD)
    try:
        with pytest.raises(pickle.UnpicklingError):
            _load(raw)
        assert "planted" not in vars(member)
    finally:
        vars(member).pop("planted", None)


def test_build_onto_a_fresh_instance_cannot_shadow_its_methods() -> None:
    raw = _stream(_global(MD, "TensorStorageMetadata"), pickle.EMPTY_TUPLE, pickle.NEWOBJ,
                  pickle.EMPTY_DICT, _text("__reduce_ex__"), pickle.NONE, pickle.SETITEM,
                  pickle.BUILD)
    with pytest.raises(pickle.UnpicklingError):
        _load(raw)


# ----- bounded before it is built --------------------------------------------------------------
def test_a_file_building_more_entries_than_its_size_is_refused() -> None:
    """400,000 one-byte empty dicts in a 400 kB file: refused by the entry bound, not built."""
    raw = _stream(pickle.EMPTY_LIST, pickle.MARK, pickle.EMPTY_DICT * 400_000, pickle.APPENDS)
    with pytest.raises(sc._TooManyEntries):
        _load(raw)


@pytest.mark.parametrize("padding", [0, 4 << 20])
def test_a_metadata_repeating_one_chunk_is_refused_before_dcp_plans(tmp_path: Path,
                                                                    padding: int) -> None:
    """Issue 46: 3 M references to one chunk (6 MB) took DCP's planner minutes and 3 GB; here
    100,000 of them, with and without padding that keeps them within the entry bound."""
    step = _save(tmp_path / "ckpt", 3)
    with open(step / ".metadata", "rb") as fh:
        metadata = pickle.load(fh)
    tensor = metadata.state_dict_metadata["model.weight"]
    tensor.chunks = [tensor.chunks[0]] * 100_000
    metadata.planner_data = "x" * padding
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError) as exc:
        sc.read_metadata(step)
    assert exc.value.path == str(step / ".metadata")


def test_a_chunk_without_stored_data_is_refused(tmp_path: Path) -> None:
    step = _save(tmp_path / "ckpt", 3)
    with open(step / ".metadata", "rb") as fh:
        metadata = pickle.load(fh)
    tensor = metadata.state_dict_metadata["model.weight"]
    tensor.chunks.append(dcp_md.ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([1, 3])))
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError) as exc:
        sc.read_metadata(step)
    assert exc.value.path == str(step / ".metadata")
