"""Checkpoint files as untrusted data (runtime/checkpoint/safeload.py, store.py): in one process.

DCP writes and reads here without a process group. A real index and the
optimizer's hyper-parameters load through the safe readers; an index holding
any other pickled object, or setting what DCP's records never set, is refused
before it is built; and a folder is complete only with its marker and every
file the marker lists, at its size. (The crafted folders of the bad-input
matrix: tests/bad_inputs/test_bad_checkpoints.py.)
"""

from __future__ import annotations

import builtins
import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from runtime.checkpoint import COMPLETE, FORMAT, incomplete_reason, latest_complete
from runtime.checkpoint.safeload import Refused, SafeLoadPlanner, SafeReader, read_metadata


class Planted:
    """Unpickled by a full unpickler, it creates the file ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.exec, (f"open({self.path!r}, 'w').close()",))


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.25)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()["param_groups"][0]}


def _save(state: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():  # DCP warns that it runs without a process group
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path)


def test_a_dcp_checkpoint_loads_through_the_safe_readers(tmp_path: Path) -> None:
    saved = _state()
    _save(saved, tmp_path)
    got: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in saved["model"].items()}}
    got["optim"] = dict.fromkeys(saved["optim"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reader = SafeReader(tmp_path, read_metadata(tmp_path))
        dcp.load(got, storage_reader=reader, planner=SafeLoadPlanner())
    for k, v in saved["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["optim"]["lr"] == 0.25 and got["optim"]["betas"] == (0.9, 0.999)


def test_an_index_holding_another_object_is_refused_before_it_runs(tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"x": Planted(str(ran))}))
    with pytest.raises(Refused, match=r"names builtins\.exec, which is not DCP metadata"):
        read_metadata(tmp_path)
    assert not ran.exists()
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"a": 1}))  # data, but not an index
    with pytest.raises(Refused, match="holds a dict, not DCP's Metadata"):
        read_metadata(tmp_path)


def test_an_index_may_set_only_the_fields_of_dcps_records(tmp_path: Path) -> None:
    # MetadataIndex.__new__(MetadataIndex), then BUILD (None, {"__class__": PosixPath}).
    crafted = pickle.PROTO + b"\x02" + pickle.GLOBAL
    crafted += b"torch.distributed.checkpoint.metadata\nMetadataIndex\n"
    crafted += pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.NONE + pickle.EMPTY_DICT
    crafted += pickle.SHORT_BINUNICODE + b"\x09__class__" + pickle.GLOBAL + b"pathlib\nPosixPath\n"
    crafted += pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD + pickle.STOP
    (tmp_path / ".metadata").write_bytes(crafted)
    with pytest.raises(
        Refused, match=r"sets special attributes of a torch\.distributed\.checkpoint\.metadata"
    ):
        read_metadata(tmp_path)
    fields = pickle.PROTO + b"\x02" + pickle.GLOBAL
    fields += b"torch.distributed.checkpoint.metadata\nMetadataIndex\n"
    fields += pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.EMPTY_DICT
    fields += pickle.SHORT_BINUNICODE + b"\x03fqn" + pickle.SHORT_BINUNICODE + b"\x01w"
    fields += pickle.SETITEM + pickle.BUILD + pickle.STOP
    (tmp_path / ".metadata").write_bytes(fields)  # a field, set: built, but not an index
    with pytest.raises(Refused, match="holds a MetadataIndex, not DCP's Metadata"):
        read_metadata(tmp_path)


def _folder(root: Path, at: int, files: dict[str, int], **marker: Any) -> Path:
    path = root / f"step-{at:08d}"
    path.mkdir(parents=True)
    for name, size in files.items():
        (path / name).write_bytes(b"x" * size)
    data = {"format": FORMAT, "step": at, "files": dict(files), **marker}
    (path / COMPLETE).write_text(json.dumps(data))
    return path


def test_a_folder_is_complete_with_its_marker_and_every_file_at_its_size(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = {".metadata": 10, "__0_0.distcp": 30}
    good = _folder(tmp_path, 1, files)
    assert incomplete_reason(good, 1) is None
    cut = _folder(tmp_path, 2, files)
    (cut / "__0_0.distcp").write_bytes(b"x" * 7)
    assert incomplete_reason(cut) == (
        "__0_0.distcp has 7 bytes, its save wrote 30 (cut short, or overwritten after the save)"
    )
    gone = _folder(tmp_path, 3, files)
    (gone / ".metadata").unlink()
    assert incomplete_reason(gone) == ".metadata is missing (the COMPLETE marker lists it)"
    old = _folder(tmp_path, 4, files, format=1)
    assert "marker is not of format 2 (got 1)" in str(incomplete_reason(old))
    other = _folder(tmp_path, 5, files, step=6)
    assert incomplete_reason(other, 5) == "its COMPLETE marker is of step 6, not 5"
    unmarked = _folder(tmp_path, 6, files)
    (unmarked / COMPLETE).unlink()
    assert incomplete_reason(unmarked) == "it has no COMPLETE marker (its save did not finish)"
    with caplog.at_level("WARNING", logger="runtime.checkpoint"):
        assert latest_complete(tmp_path) == good
        assert latest_complete(tmp_path) == good
    skipped = [r.getMessage() for r in caplog.records]
    assert len(skipped) == 5, skipped  # once per folder, newest first
    assert skipped[0].startswith(f"skipping incomplete checkpoint {unmarked}: it has no COMPLETE")
