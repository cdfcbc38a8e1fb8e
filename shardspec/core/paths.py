"""The rules for the files a checkpoint folder names: which names are files inside the folder.

**Hugging Face checkpoints** (:func:`escape`): a file an index names (or one of the folder's
fixed names, ``model.safetensors``, its index, ``config.json``) is a plain relative path
whose folders stay inside the checkpoint folder and whose file, symlinks followed, is
inside it too. A plain relative path is ``/``-separated, with no empty, ``.`` or ``..``
part and no backslash, and is not absolute (``/x``, ``\\x``, ``C:x``). Links are followed
where they stay inside the folder. One kind of link leads out: Hugging Face's cache, where
a snapshot ``<repo>/snapshots/<revision>/`` links every file to a file directly in
``<repo>/blobs/`` (``snapshots/abc/model.safetensors -> ../../blobs/<hash>``). Any other
link out (to ``/etc/passwd``, to another folder) is refused before it is opened.

Both ``load_hf`` (:mod:`shardspec.runtime.hf`, which reads the bytes) and ``shardspec
hf-manifest`` (:mod:`shardspec.inputs.hfmanifest`, which reads the headers) apply it.

**DCP checkpoints** (:func:`file_escape`): a data file that DCP's ``.metadata`` names is a
plain file name directly in the checkpoint folder (no folder part at all), and not a link
out of it. ``load`` applies it to every checkpoint, trusted or not.

Pure Python: no torch, no pydantic.
"""

from __future__ import annotations

import os
import re
from enum import Enum

__all__ = ["Escape", "escape", "file_escape", "inside"]

_DRIVE = re.compile(r"^[A-Za-z]:")


class Escape(Enum):
    """Why a name is not a file inside the folder; the value completes ``"file NAME ..."``."""

    NO_NAME = "is not a file name"
    ABSOLUTE = "is an absolute path"
    PARENT = "escapes the directory"
    NOT_PLAIN = "is not a plain relative path (empty, '.' or backslash parts)"
    LINK_OUT = "is in a folder that links outside the directory"
    FILE_LINK_OUT = (
        "is a link to a file outside the directory (only Hugging Face's cache links out, "
        "from snapshots/<revision>/ to ../../blobs/)"
    )
    IN_FOLDER = "is not a plain file name in the directory (it names a folder too)"
    DATA_LINK_OUT = "is a link to a file outside the directory"


def _text_escape(name: object) -> Escape | None:
    """What is wrong with ``name`` as text alone (no file system)."""
    if not isinstance(name, str) or not name or "\0" in name:
        return Escape.NO_NAME
    if os.path.isabs(name) or name.startswith(("/", "\\")) or _DRIVE.match(name):
        return Escape.ABSOLUTE
    parts = re.split(r"[\\/]", name)
    if ".." in parts:
        return Escape.PARENT
    if "\\" in name or any(p in ("", ".") for p in parts):
        return Escape.NOT_PLAIN
    return None


def _within(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _hf_blob(real_root: str, real_file: str) -> bool:
    """Whether ``real_file`` is where Hugging Face's cache links a snapshot's files: a file
    directly in ``<repo>/blobs`` for the snapshot ``<repo>/snapshots/<revision>``."""
    snapshots = os.path.dirname(real_root)
    if os.path.basename(snapshots) != "snapshots":
        return False
    blobs = os.path.join(os.path.dirname(snapshots), "blobs")
    return os.path.dirname(real_file) == blobs


def escape(root: str | os.PathLike[str], name: object) -> Escape | None:
    """Why ``root/name`` is not a file of the Hugging Face checkpoint folder ``root``, or
    None when it is (see the module's rule). Only ``LINK_OUT`` and ``FILE_LINK_OUT`` look at
    the file system."""
    why = _text_escape(name)
    if why is not None:
        return why
    assert isinstance(name, str)
    real_root = os.path.realpath(root)
    full = os.path.join(root, name)
    if not _within(os.path.realpath(os.path.dirname(full)), real_root):
        return Escape.LINK_OUT
    real = os.path.realpath(full)
    if not _within(real, real_root) and not _hf_blob(real_root, real):
        return Escape.FILE_LINK_OUT
    return None


def file_escape(root: str | os.PathLike[str], name: object) -> Escape | None:
    """Why ``root/name`` is not a data file of the DCP checkpoint folder ``root``, or None:
    a plain file name (no folder part), not a link out of the folder."""
    why = _text_escape(name)
    if why is not None:
        return why
    assert isinstance(name, str)
    if "/" in name:
        return Escape.IN_FOLDER
    if ":" in name:
        return Escape.NOT_PLAIN
    real_root = os.path.realpath(root)
    if not _within(os.path.realpath(os.path.join(root, name)), real_root):
        return Escape.DATA_LINK_OUT
    return None


def inside(root: str | os.PathLike[str], name: object) -> bool:
    """True when ``root/name`` is a file name inside ``root`` (:func:`escape` finds nothing)."""
    return escape(root, name) is None
