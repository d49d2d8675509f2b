"""Reading named tensors from a weights file into tensors that already exist: safetensors or DCP.

Example::

    source = open_weights("init.safetensors")        # or a DCP folder
    key = source.key("blocks.0.attn.qkv.weight")     # None when the file lacks it
    source.load({key: stage_tensor})                  # read in place, dtype converted

Used by :class:`runtime.materialize.StageWeights` (``--init-from``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["WeightsSource", "open_weights"]

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors' dtype names (in its header) → torch's."""

_MARKER = "COMPLETE"
"""A runtime checkpoint's marker (``runtime.checkpoint.store.COMPLETE``; importing the
store here would import the engine, which imports this module)."""


class WeightsSource(Protocol):
    """Named tensors on disk."""

    path: Path

    def key(self, name: str) -> str | None:
        """The key holding the model's tensor ``name``, or None."""

    def load(self, dest: Mapping[str, Tensor]) -> None:
        """Read every ``key → tensor`` of ``dest`` into the tensor (any device, dtype converted)."""


def open_weights(path: str | os.PathLike[str]) -> WeightsSource:
    """A safetensors file, or a DCP folder (a runtime checkpoint's step folder: its ``model/``).

    Raises:
        ValueError: ``path`` does not exist, or is neither (the message says what it is).
    """
    path = Path(path)
    if path.is_file():
        return _Safetensors(path)
    if (path / ".metadata").is_file():
        return _Dcp(path)
    what = "does not exist" if not path.exists() else "is a folder without DCP's .metadata"
    raise ValueError(
        f"--init-from {path} {what}; it must be a .safetensors file or a DCP checkpoint folder.\n"
        "  fix: write one with `planner init-weights MODEL --out FILE`, or point it at a "
        "pretrained model.safetensors or a checkpoint step folder (step-00000400)"
    )


def _check_shape(path: Path, key: str, have: Any, dest: Tensor) -> None:
    if tuple(have) != tuple(dest.shape):
        raise ValueError(
            f"{path}: {key!r} has shape {list(have)}, but the model's tensor has "
            f"{list(dest.shape)}; the file was written for another configuration of the model.\n"
            "  fix: rewrite it from this model file (`planner init-weights`), or build the "
            "model the file was made for"
        )


class _Safetensors:
    """A safetensors file read tensor by tensor straight into the destination's storage.

    The format: 8 bytes (little-endian) of header length, a JSON header (name →
    dtype, shape, [begin, end) byte offsets after the header), the data. A CPU
    destination of the file's dtype is read into directly (no second copy, no
    mapped pages left resident); any other goes through one tensor's buffer.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little")
            try:
                if len(head) != 8 or n > os.path.getsize(path):
                    raise ValueError("too short")
                header = json.loads(f.read(n))
            except ValueError as exc:
                raise ValueError(
                    f"--init-from {path} is not a safetensors file ({exc}); give a .safetensors "
                    "file or a DCP checkpoint folder"
                ) from None
        header.pop("__metadata__", None)
        self._start = 8 + n
        self._entries: dict[str, Any] = header

    def key(self, name: str) -> str | None:
        return name if name in self._entries else None

    def load(self, dest: Mapping[str, Tensor]) -> None:
        with open(self.path, "rb") as f:
            for key, tensor in dest.items():
                entry = self._entries[key]
                if entry["dtype"] not in _DTYPES:
                    raise ValueError(f"{self.path}: {key!r} has dtype {entry['dtype']}, unknown")
                dtype = _DTYPES[entry["dtype"]]
                _check_shape(self.path, key, entry["shape"], tensor)
                direct = tensor.device.type == "cpu" and tensor.dtype == dtype
                buf = (
                    tensor
                    if direct and tensor.is_contiguous()
                    else torch.empty_like(
                        tensor, dtype=dtype, device="cpu", memory_format=torch.contiguous_format
                    )
                )
                begin, end = entry["data_offsets"]
                f.seek(self._start + begin)
                raw = buf.detach().reshape(-1).view(torch.uint8)
                got = f.readinto(raw.numpy().data) if raw.numel() else 0
                if got != end - begin or raw.numel() != end - begin:
                    raise ValueError(
                        f"{self.path}: {key!r} should hold {end - begin} bytes, read {got} "
                        f"(the tensor has {raw.numel()}): the file is cut short or damaged"
                    )
                if buf is not tensor:
                    with torch.no_grad():
                        tensor.copy_(buf)


class _Dcp:
    """A DCP folder: one partial ``dcp.load`` of the keys asked for, its index read safely.

    In a runtime checkpoint (a ``COMPLETE`` marker) the model's tensors are
    ``model.<name>``; in any other DCP folder, ``<name>``.
    """

    def __init__(self, path: Path) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from runtime.checkpoint.safeload import Refused, read_metadata, refused_message

        self.path = path
        try:
            self._metadata = read_metadata(path)
        except Refused as exc:
            raise ValueError(refused_message(path, str(exc))) from None
        self._prefix = "model." if (path / _MARKER).is_file() else ""
        self._sizes = {
            k: tuple(v.size)
            for k, v in self._metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
        }

    def key(self, name: str) -> str | None:
        key = self._prefix + name
        return key if key in self._sizes else None

    def load(self, dest: Mapping[str, Tensor]) -> None:
        import torch.distributed.checkpoint as dcp

        from runtime.checkpoint.safeload import SafeLoadPlanner, SafeReader

        if not dest:
            return
        for key, tensor in dest.items():
            _check_shape(self.path, key, self._sizes[key], tensor)
        dcp.load(
            dict(dest),
            storage_reader=SafeReader(self.path, self._metadata),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
