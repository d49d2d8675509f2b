"""Reading a DCP checkpoint as data only: no pickled object of another kind is ever built.

Used by ``runtime.checkpoint.load`` (see [Note: what a checkpoint may contain]).

Example::

    metadata = read_metadata("ckpt/step-00000400")     # refuses a crafted index
    reader, planner = SafeReader(path, metadata), SafeLoadPlanner()
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except (Exception, CheckpointException) as exc:
        if refusal(exc) is not None: ...              # a crafted entry, on every rank
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

__all__ = [
    "METADATA",
    "Refused",
    "SafeLoadPlanner",
    "SafeReader",
    "read_metadata",
    "refusal",
    "refused_message",
]

METADATA = ".metadata"
"""DCP's index file inside a checkpoint folder."""


# [Note: what a checkpoint may contain]
# A DCP checkpoint is DCP's index (.metadata, a pickle) and data files whose
# entries are torch.save archives: tensors, and for non-tensor values (here the
# optimizer's hyper-parameters) the pickled value. DCP reads the index with
# pickle.load and non-tensor values with torch.load(weights_only=False): either
# would run code that a crafted checkpoint put there. Here the index goes
# through _MetadataUnpickler (DCP's metadata classes, torch.Size, dtypes,
# layouts, paths: nothing else) and every entry through
# torch.load(weights_only=True) (tensors, numbers, strings, containers).
# Anything else is refused, with the same message on every rank.


class Refused(pickle.UnpicklingError):
    """A checkpoint entry that is not plain data (see the note above)."""


def refused_message(path: str | os.PathLike[str], what: str) -> str:
    """The error for a refused checkpoint: what was found, why it is refused, the fix."""
    return (
        f"checkpoint {path} refused: {what}. Checkpoints are read as data only "
        "(torch.load(weights_only=True), and DCP's own classes in its index): a pickled "
        "object of another kind could run code as it loads.\n  fix: load only checkpoints "
        "this runtime saved, from a source you trust; a value of your own in a state dict "
        "must be a tensor, number, string or container of them"
    )


def refusal(exc: BaseException) -> str | None:
    """The message of a ``Refused`` inside ``exc`` (DCP wraps every rank's failures)."""
    stack: list[Any] = [exc]
    seen: set[int] = set()
    while stack:
        e = stack.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, Refused):
            return str(e)
        if isinstance(e, CheckpointException):
            stack += [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        stack += [e.__cause__, e.__context__]
    return None


_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a torch.layout by name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    *((m, c) for m in ("pathlib", "pathlib._local") for c in ("PosixPath", "WindowsPath")),
    *((m, c) for m in ("pathlib", "pathlib._local") for c in ("PurePosixPath", "PureWindowsPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's index: its metadata classes and a few torch values, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        where = (module, name)
        if module == "torch.distributed.checkpoint.metadata" or where in _METADATA_GLOBALS:
            obj = super().find_class(module, name)
            if isinstance(obj, type) or where == ("torch.serialization", "_get_layout"):
                return obj
        elif module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise Refused(f"its {METADATA} names {module}.{name}, which is not DCP metadata")


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """DCP's index of checkpoint folder ``path``, unpickled safely (see the note above).

    Raises:
        pickle.UnpicklingError: the index holds an object of another kind (refused
            before it is built), or is not a pickle.
        OSError: there is no index.
    """
    with open(Path(path) / METADATA, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise Refused(f"its {METADATA} holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file-system reader, with the index already read by :func:`read_metadata`."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's per-rank fallback: this runtime writes none
            raise FileNotFoundError(f"no per-rank metadata in {self.path}")
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        assert self._metadata.storage_meta is not None
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with ``weights_only=True``.

    DCP stores non-tensor values (here: optimizer hyper-parameters such as
    ``lr`` and ``betas``) with ``torch.save`` and its default planner reads them
    back with ``torch.load(weights_only=False)``, a full unpickler; plain
    numbers, strings, tuples, lists and dicts need no more than the safe one.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
            why = next((x for x in lines if "Unsupported global" in x), lines[0] if lines else "")
            why = why.removeprefix("WeightsUnpickler error: ").split(". Please use")[0]
            raise Refused(f"entry {fqn!r} holds a pickled object, not data ({why})") from exc
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
