"""Bad-input cases 10-12 of issue 15: crafted checkpoint folders are refused, data-only and bounded.

One small DCP save (one process, no process group) makes a real folder; each
case crafts one file of it and reads it the way a resume does
(``runtime.checkpoint.safeload.load_state``, what ``runtime.checkpoint.load``
calls on every rank; ``incomplete_reason`` for the marker). Each refusal says
what, why and the fix, before a byte of anything it refuses is read or built.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import pathlib
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

from runtime.checkpoint import COMPLETE, FORMAT, incomplete_reason
from runtime.checkpoint.safeload import CheckpointRefused, load_state, read_metadata

GIB = 2**30
POLLUTED = "_bad_checkpoints_polluted"  # the class attribute a crafted index sets


class Planted:
    """Unpickled by a full unpickler, it creates the file ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.exec, (f"open({self.path!r}, 'w').close()",))


def _saved(folder: Path) -> dict[str, Any]:
    """A small real checkpoint in ``folder`` (weights, hyper-parameters, step); its state."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    state = {"model": model.state_dict(), "lr": 0.25, "step": torch.tensor(7)}
    with warnings.catch_warnings():  # DCP warns that it runs without a process group
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=folder)
    return state


def _load(folder: Path) -> dict[str, Any]:
    model = {k: torch.zeros(v) for k, v in {"weight": (2, 3), "bias": (2,)}.items()}
    state: dict[str, Any] = {"model": model, "lr": 0.0, "step": torch.tensor(0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_state(folder, state)
    return state


def _refused(folder: Path) -> str:
    with pytest.raises(CheckpointRefused) as err:
        _load(folder)
    message = str(err.value)
    assert message.startswith(f"checkpoint {folder} refused: "), message
    assert "\n  fix: " in message, message
    return message


def _records(folder: Path) -> tuple[Metadata, dict[str, Any]]:
    metadata = read_metadata(folder)
    return metadata, {k.fqn: k for k in metadata.storage_data}


def _rewrite(folder: Path, metadata: Metadata) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def test_the_crafting_starts_from_a_folder_that_loads(tmp_path: Path) -> None:
    saved = _saved(tmp_path)
    got = _load(tmp_path)
    assert torch.equal(got["model"]["weight"], saved["model"]["weight"])
    assert got["lr"] == 0.25 and int(got["step"]) == 7


# --------------------------------------------------------------------------- 10. BUILD


def test_case10_an_index_that_sets_a_class_attribute_is_refused_before_it_does(
    tmp_path: Path,
) -> None:
    _saved(tmp_path)
    real = pickle.dumps(read_metadata(tmp_path), protocol=2)
    # GLOBAL pathlib.PosixPath; BUILD (None, {POLLUTED: 'yes'}): setattr on the class; POP;
    # then the real index, so that a plain unpickler returns it and the resume goes on.
    build = pickle.GLOBAL + b"pathlib\nPosixPath\n" + pickle.NONE + pickle.EMPTY_DICT
    build += pickle.BINUNICODE + len(POLLUTED).to_bytes(4, "little") + POLLUTED.encode()
    build += pickle.SHORT_BINUNICODE + b"\x03yes" + pickle.SETITEM + pickle.TUPLE2
    crafted = real[:2] + build + pickle.BUILD + pickle.POP + real[2:]
    try:  # the crafted index does what it says to a plain unpickler
        assert isinstance(pickle.Unpickler(io.BytesIO(crafted)).load(), Metadata)
        assert getattr(pathlib.PosixPath, POLLUTED) == "yes"
    finally:
        delattr(pathlib.PosixPath, POLLUTED)
    (tmp_path / ".metadata").write_bytes(crafted)
    message = _refused(tmp_path)
    assert not hasattr(pathlib.PosixPath, POLLUTED)
    assert (
        "its .metadata sets the state of the class pathlib.PosixPath (pickle's BUILD), which is "
        "not one of DCP's metadata records. The checkpoint holds code, not only data"
    ) in message
    assert "fix: do not load this checkpoint; resume from one saved by a run you trust" in message


def test_case10_an_index_that_fills_an_object_as_a_container_is_refused(tmp_path: Path) -> None:
    _saved(tmp_path)
    # PosixPath('x'), then SETITEM on it: a plain unpickler calls the object's __setitem__.
    crafted = pickle.PROTO + b"\x02" + pickle.GLOBAL + b"pathlib\nPosixPath\n"
    crafted += pickle.SHORT_BINUNICODE + b"\x01x" + pickle.TUPLE1 + pickle.REDUCE
    crafted += pickle.SHORT_BINUNICODE + b"\x01k" + pickle.NONE + pickle.SETITEM + pickle.STOP
    (tmp_path / ".metadata").write_bytes(crafted)
    message = _refused(tmp_path)
    assert "its .metadata fills pathlib" in message and "(pickle's SETITEM)" in message


# --------------------------------------------------------------------------- 11. record paths


@pytest.mark.timeout(60)  # a FIFO that were opened would block until this
def test_case11_records_must_be_regular_files_inside_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "step-00000007"
    _saved(folder)
    (tmp_path / "outside.bin").write_bytes(b"\0" * 4096)
    (folder / "zero.distcp").symlink_to("/dev/zero")
    os.mkfifo(folder / "fifo.distcp")
    cases = {
        "/dev/zero": "record 'model.weight' names '/dev/zero', an absolute path: its files are "
        "inside its folder",
        "../outside.bin": f"record 'model.weight' names '../outside.bin', which resolves to "
        f"{tmp_path / 'outside.bin'}, outside the folder",
        "zero.distcp": "record 'model.weight' names 'zero.distcp', which resolves to /dev/zero, "
        "outside the folder",
        "fifo.distcp": "record 'model.weight' names 'fifo.distcp', which is a FIFO (reading it "
        "would wait for a writer), not a regular file",
        "gone.distcp": "record 'model.weight' names 'gone.distcp', which is missing",
    }
    pristine = (folder / ".metadata").read_bytes()
    for name, why in cases.items():
        metadata, keys = _records(folder)
        metadata.storage_data[keys["model.weight"]] = _StorageInfo(name, 0, 8 * GIB)
        _rewrite(folder, metadata)
        message = _refused(folder)
        assert why in message, (why, message)
        assert "so this one is damaged or was not written by this runtime" in message
        assert "fix: resume from another complete checkpoint" in message
        (folder / ".metadata").write_bytes(pristine)


def test_case11_a_record_longer_than_its_file_is_refused_before_any_read(tmp_path: Path) -> None:
    _saved(tmp_path)
    metadata, keys = _records(tmp_path)
    info = metadata.storage_data[keys["model.bias"]]
    size = (tmp_path / info.relative_path).stat().st_size
    metadata.storage_data[keys["model.bias"]] = _StorageInfo(
        info.relative_path, info.offset, 8 * GIB
    )
    _rewrite(tmp_path, metadata)
    message = _refused(tmp_path)
    assert (
        f"record 'model.bias' claims bytes {info.offset}..{info.offset + 8 * GIB} of "
        f"{info.relative_path}, which has {size} (nothing was read)"
    ) in message


@pytest.mark.timeout(60)
def test_case11_the_index_itself_must_be_a_regular_file_of_the_folder(tmp_path: Path) -> None:
    _saved(tmp_path)
    (tmp_path / ".metadata").unlink()
    (tmp_path / ".metadata").symlink_to("/dev/zero")
    assert "its index is '.metadata', which resolves to /dev/zero, outside" in _refused(tmp_path)
    (tmp_path / ".metadata").unlink()
    os.mkfifo(tmp_path / ".metadata")
    assert "its index is '.metadata', which is a FIFO" in _refused(tmp_path)


@pytest.mark.timeout(60)
def test_case11_the_marker_lists_only_files_of_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "step-00000007"
    _saved(folder)
    sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
    marker = {"format": FORMAT, "step": 7, "files": sizes}
    (folder / COMPLETE).write_text(json.dumps(marker))
    assert incomplete_reason(folder, 7) is None
    marker["files"] = {**sizes, "../../../etc/passwd": Path("/etc/passwd").stat().st_size}
    (folder / COMPLETE).write_text(json.dumps(marker))
    assert incomplete_reason(folder, 7) == (
        "its COMPLETE marker is not this runtime's: it lists '../../../etc/passwd', which "
        f"resolves to {(folder / '../../../etc/passwd').resolve()}, outside the folder"
    )
    (folder / COMPLETE).unlink()
    os.mkfifo(folder / COMPLETE)
    assert incomplete_reason(folder, 7) == (
        "its COMPLETE marker is refused: the marker is 'COMPLETE', which is a FIFO (reading it "
        "would wait for a writer), not a regular file"
    )
    (folder / COMPLETE).unlink()
    (folder / COMPLETE).write_text("[" * 100_000)
    assert "its COMPLETE marker is unreadable (RecursionError" in str(incomplete_reason(folder))


# --------------------------------------------------------------------------- 12. pickled tensor


def test_case12_a_pickle_in_a_tensor_record_is_refused_in_the_runtimes_words(
    tmp_path: Path,
) -> None:
    _saved(tmp_path)
    ran = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save(Planted(str(ran)), buf)
    metadata, keys = _records(tmp_path)
    info = metadata.storage_data[keys["model.weight"]]
    data = tmp_path / info.relative_path
    offset = data.stat().st_size
    with data.open("ab") as f:
        f.write(buf.getvalue())
    metadata.storage_data[keys["model.weight"]] = _StorageInfo(
        info.relative_path, offset, len(buf.getvalue())
    )
    _rewrite(tmp_path, metadata)
    message = _refused(tmp_path)
    assert not ran.exists()
    end = offset + len(buf.getvalue())
    assert (
        f"tensor record 'model.weight' ({info.relative_path}, bytes {offset}..{end}) holds a "
        "pickled Python object, not tensor data (Unsupported global: GLOBAL "
    ) in message
    assert "The checkpoint holds code, not only data" in message
    assert "fix: do not load this checkpoint; resume from one saved by a run you trust" in message
    assert "weights_only set to False will likely succeed" not in message
    assert "Re-running" not in message
