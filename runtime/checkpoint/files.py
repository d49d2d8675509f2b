"""The files a checkpoint folder may hold: regular files inside it, of bounded size.

Used by ``safeload`` (DCP's index and the records it lists) and ``store`` (the
``COMPLETE`` marker and the files it lists).

[Note: a checkpoint reads only its own files] DCP's index records, for each
entry, a file name, an offset and a length, and the marker lists file names;
read as they are, an absolute name (``/etc/passwd``), a ``..`` or a symlink out
of the folder would be followed, ``/dev/zero`` with an 8 GiB length would be
read until memory ran out, and a FIFO would block the rank reading it until the
job's timeout. So a name is resolved (symlinks followed) and must stay inside
the folder, name a regular file (``os.stat``), and, for a record, the file must
hold the bytes it claims: all checked before a byte of it is read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["MAX_MARKER_BYTES", "MAX_METADATA_BYTES", "Malformed", "Missing", "regular_file_in"]

MAX_METADATA_BYTES = 1 << 30
"""The largest DCP index read (1 GiB; a 70 B-parameter model's is a few MiB)."""
MAX_MARKER_BYTES = 16 << 20
"""The largest ``COMPLETE`` marker read (16 MiB; the runtime writes a few KiB)."""

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (reading it would wait for a writer)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


class Malformed(ValueError):
    """A checkpoint's file is not what its index or marker says (see the note above)."""


class Missing(Malformed):
    """The file is not there (a save that did not finish, or a file removed since)."""


def regular_file_in(
    folder: Path, name: object, *, max_bytes: int | None = None, who: str = "it lists"
) -> tuple[Path, int]:
    """The regular file ``name`` inside ``folder``, and its size; nothing is read.

    Example::

        path, size = regular_file_in(Path("ckpt/step-00000400"), "__0_0.distcp")

    Args:
        folder: the checkpoint folder.
        name: a name relative to it, as the index or the marker records it.
        max_bytes: refuse a larger file.
        who: what names it, to begin the message with ("record 'model.w' names").

    Raises:
        Missing: there is no such file.
        Malformed: ``name`` is not a relative path, resolves outside ``folder``
            (a ``..`` or a symlink out of it), is not a regular file, or is larger
            than ``max_bytes``.
    """
    if not isinstance(name, str) or not name or "\0" in name:
        raise Malformed(f"{who} the file {name!r}, which is not a file name")
    if Path(name).is_absolute():
        raise Malformed(f"{who} {name!r}, an absolute path: its files are inside its folder")
    root = folder.resolve()
    target = (root / name).resolve()
    if not target.is_relative_to(root):
        raise Malformed(f"{who} {name!r}, which resolves to {target}, outside the folder")
    try:
        st = os.stat(target)
    except FileNotFoundError:
        raise Missing(f"{who} {name!r}, which is missing") from None
    except OSError as exc:
        raise Malformed(f"{who} {name!r}, which cannot be read ({exc.strerror or exc})") from exc
    if not stat.S_ISREG(st.st_mode):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise Malformed(f"{who} {name!r}, which is {kind}, not a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise Malformed(f"{who} {name!r} of {st.st_size} bytes, more than the {max_bytes} read")
    return target, st.st_size
