"""Reading a DCP checkpoint as data only, and within its folder: nothing but data is built.

Used by ``runtime.checkpoint.load`` (see [Note: what a checkpoint may contain]
and [Note: a checkpoint reads only its own files]).

Example::

    load_state("ckpt/step-00000400", state)      # refuses a crafted index or record
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, ClassVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from runtime.checkpoint.files import MAX_METADATA_BYTES, Malformed, regular_file_in

__all__ = [
    "METADATA",
    "CheckpointRefused",
    "Malformed",
    "Refused",
    "SafeLoadPlanner",
    "SafeReader",
    "load_state",
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
# layouts, paths: nothing else; the state of DCP's own records only set, never a
# class's: pickle's BUILD on an allowed class would set attributes of that class
# in the loading process; containers filled only when they are dicts, lists and
# sets) and every entry through torch.load(weights_only=True) (tensors, numbers,
# strings, containers). Anything else is refused, with the same message on every
# rank, and a message of this runtime's own: torch's advises loading it with
# weights_only=False, which would run the code.


class Refused(pickle.UnpicklingError):
    """A checkpoint entry that is not plain data (see the note above)."""


class CheckpointRefused(ValueError):
    """A checkpoint that :func:`load_state` will not read (the message says what, why, the fix)."""


def refused_message(path: str | os.PathLike[str], what: str) -> str:
    """The error for a refused checkpoint: what was found, why it is refused, the fix."""
    return (
        f"checkpoint {path} refused: {what}. The checkpoint holds code, not only data: "
        "checkpoints are read as data only (torch.load(weights_only=True), and DCP's own "
        "records in its index), and loading this one any other way (weights_only=False "
        "included) would run that code.\n  fix: do not load this checkpoint; resume from "
        "one saved by a run you trust, or re-save it from that run (a value of your own in a "
        "state dict must be a tensor, number, string or container of them)"
    )


def malformed_message(path: str | os.PathLike[str], what: str) -> str:
    """The error for a checkpoint whose files are not what its index says."""
    return (
        f"checkpoint {path} refused: {what}. A checkpoint's index is DCP's own and names "
        "regular files inside its folder that hold the bytes it records (nothing else is "
        "read), so this one is damaged or was not written by this runtime.\n  fix: resume "
        "from another complete checkpoint (move this folder away: latest_complete then "
        "finds the one before it), or start fresh with another checkpoint directory"
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


_CONTAINERS: dict[int, tuple[type, ...]] = {
    pickle.SETITEM[0]: (dict,),
    pickle.SETITEMS[0]: (dict,),
    pickle.APPEND[0]: (list,),
    pickle.APPENDS[0]: (list,),
    pickle.ADDITEMS[0]: (set,),
}
"""The opcodes that fill a container, and the containers they may fill (an OrderedDict is a
dict): on any other object they call its own __setitem__, append or add."""


def _buildable(obj: Any) -> bool:
    """Whether BUILD (which sets an object's state) may act on ``obj``: an instance of DCP's
    own metadata records only, never a class (BUILD on a class sets class attributes: a
    crafted index could change pathlib or torch in the loading process)."""
    if isinstance(obj, type):
        return False
    cls = type(obj)
    return cls.__module__ == "torch.distributed.checkpoint.metadata" or cls is _StorageInfo


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP's index: its metadata classes and a few torch values, nothing else.

    The pure-Python unpickler, whose opcodes can be checked one by one: classes by
    :meth:`find_class`, and every opcode that changes an object already built (BUILD,
    and the container fillers) by the kind of object it acts on.
    """

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)

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

    def _build(self) -> None:
        target, state = self.stack[-2:]  # type: ignore[attr-defined]  # the pure one's stack
        if not _buildable(target):
            what = f"the class {_name(target)}" if isinstance(target, type) else _name(target)
            raise Refused(
                f"its {METADATA} sets the state of {what} (pickle's BUILD), which is not one "
                "of DCP's metadata records"
            )
        if _dunders(state):
            raise Refused(f"its {METADATA} sets special attributes of a {_name(target)}")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]  # undocumented

    dispatch[pickle.BUILD[0]] = _build


def _guard(code: int, load: Callable[[Any], None]) -> None:
    """Replace opcode ``code``'s handler by one that first checks the container it fills."""
    allowed = _CONTAINERS[code]
    opname = next(op.name for op in pickletools.opcodes if ord(op.code) == code)

    def guarded(self: Any) -> None:
        if code == pickle.SETITEM[0]:  # stack: ... container key value
            target = self.stack[-3]
        elif code == pickle.APPEND[0]:  # stack: ... container value
            target = self.stack[-2]
        else:  # stack: ... container MARK items...: the container tops the stack below the mark
            target = self.metastack[-1][-1]
        if isinstance(target, type) or not isinstance(target, allowed):
            raise Refused(
                f"its {METADATA} fills {_name(target)} as a container (pickle's {opname}), "
                f"which is not a {allowed[0].__name__}"
            )
        load(self)

    _MetadataUnpickler.dispatch[code] = guarded


def _dunders(state: Any) -> bool:
    """Whether a BUILD state would set a name like ``__class__`` (or one not a string)."""
    parts = state if isinstance(state, tuple) else (state,)
    keys = [k for part in parts if isinstance(part, dict) for k in part]
    return any(not isinstance(k, str) or k.startswith("__") for k in keys)


def _name(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


for _code in _CONTAINERS:
    _guard(_code, pickle._Unpickler.dispatch[_code])


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """DCP's index of checkpoint folder ``path``, unpickled safely, its records checked.

    See [Note: what a checkpoint may contain] and [Note: a checkpoint reads only its
    own files]: every record must name a regular file inside the folder that holds
    the bytes it records.

    Raises:
        Refused: the index holds an object of another kind, or changes one (refused
            before it is built).
        Malformed: the index is missing, not a regular file, too large, not a pickle
            of DCP's Metadata, or a record points outside the folder or past a file's end
            (the whole message, as :func:`malformed_message` words it).
    """
    try:
        return _read_metadata(Path(path))
    except Malformed as exc:  # the whole message: weights.py raises it as it is
        raise Malformed(malformed_message(path, str(exc))) from None


def _read_metadata(folder: Path) -> Metadata:
    index, size = regular_file_in(
        folder, METADATA, max_bytes=MAX_METADATA_BYTES, who="its index is"
    )
    try:
        with open(index, "rb") as f:
            data = f.read(size + 1)
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Refused:
        raise
    except OSError as exc:
        raise Malformed(f"its {METADATA} cannot be read ({exc.strerror or exc})") from exc
    except Exception as exc:  # a damaged pickle: EOFError, UnpicklingError, a bad state, ...
        raise Malformed(
            f"its {METADATA} is not a pickle of DCP's index ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(metadata, Metadata):
        raise Refused(f"its {METADATA} holds a {type(metadata).__name__}, not DCP's Metadata")
    _check_records(folder, metadata)
    return metadata


def _check_records(folder: Path, metadata: Metadata) -> None:
    """Every storage record names a regular file in ``folder`` holding its bytes."""
    records = metadata.storage_data
    if not isinstance(records, dict):
        raise Malformed(f"its {METADATA} has no table of records (got {type(records).__name__})")
    sizes: dict[str, int] = {}
    for key, info in records.items():
        fqn = key.fqn if isinstance(key, MetadataIndex) else repr(key)
        if not isinstance(info, _StorageInfo):
            raise Malformed(f"record {fqn!r} of its {METADATA} is a {type(info).__name__}")
        name, offset, length = info.relative_path, info.offset, info.length
        if not isinstance(name, str) or not _whole(offset) or not _whole(length):
            raise Malformed(
                f"record {fqn!r} is not (file, offset, length): {name!r}, {offset!r}, {length!r}"
            )
        if name not in sizes:
            sizes[name] = regular_file_in(folder, name, who=f"record {fqn!r} names")[1]
        if offset + length > sizes[name]:
            raise Malformed(
                f"record {fqn!r} claims bytes {offset}..{offset + length} of {name}, which "
                f"has {sizes[name]} (nothing was read)"
            )


def _whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class SafeReader(FileSystemReader):
    """DCP's file-system reader, with the index already read by :func:`read_metadata`."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata
        self._reading: _StorageInfo | None = None  # the record being read

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's per-rank fallback: this runtime writes none
            raise FileNotFoundError(f"no per-rank metadata in {self.path}")
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        assert self._metadata.storage_meta is not None
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def _slice_file(self, file: Any, sinfo: _StorageInfo) -> IO[bytes]:
        self._reading = sinfo  # the record a failure below is about
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._reading = None
        try:
            return super().read_data(plan, planner)
        except pickle.UnpicklingError as exc:
            if isinstance(exc, Refused):
                raise
            info = self._reading
            fqn = next((k.fqn for k, v in self.storage_data.items() if v is info), "?")
            end = info.offset + info.length if info else 0
            where = f"{info.relative_path}, bytes {info.offset}..{end}" if info else "?"
            raise Refused(
                f"tensor record {fqn!r} ({where}) holds a pickled Python object, not tensor "
                f"data ({_torch_why(exc)})"
            ) from exc


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
            raise Refused(
                f"entry {fqn!r} holds a pickled object, not data ({_torch_why(exc)})"
            ) from exc
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _torch_why(exc: BaseException) -> str:
    """What torch's weights-only unpickler found, without its advice to load it unsafely."""
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
    why = next((x for x in lines if x.startswith("WeightsUnpickler error:")), "")
    why = why.removeprefix("WeightsUnpickler error: ").split(". Please use")[0]
    return why.rstrip(".") or "not a tensor archive torch.load(weights_only=True) reads"


def load_state(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Read checkpoint folder ``path`` into ``state`` in place (DCP's load), as data only.

    Example::

        state = {"model": model.state_dict()}
        load_state("ckpt/step-00000400", state)

    No communication beyond DCP's own (none without a process group). The index is
    read by :func:`read_metadata` (classes and records checked before anything else is
    read), every entry with ``torch.load(weights_only=True)``.

    Raises:
        CheckpointRefused: the index or an entry holds code, or a record points outside
            the folder, at something not a regular file, or past a file's end (the
            message says which, why, and what to do; the same on every rank).
        CheckpointException: anything else DCP raises (a key the checkpoint lacks, ...).
    """
    try:
        metadata = read_metadata(path)
    except Refused as exc:
        raise CheckpointRefused(refused_message(path, str(exc))) from None
    except Malformed as exc:
        raise CheckpointRefused(str(exc)) from None
    try:
        dcp.load(state, storage_reader=SafeReader(Path(path), metadata), planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        refused = refusal(exc)
        if refused is not None:  # the root cause, for runtime.failure: not torch's advice
            raise CheckpointRefused(refused_message(path, refused)) from None
        raise
