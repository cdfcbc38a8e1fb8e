"""The one rule for a file that a Hugging Face checkpoint's index (or the checkpoint
folder's fixed names, ``model.safetensors`` and its index) names: it is a plain relative
path that stays inside the checkpoint folder, symlinks followed.

A plain relative path is ``/``-separated, with no empty, ``.`` or ``..`` part and no
backslash, and is not absolute (``/x``, ``\\x``, ``C:x``). A symlink inside the folder is
fine as long as it resolves inside the folder; one that resolves outside is refused (so a
Hugging Face cache snapshot, whose files link into ``../../blobs``, must be copied with
``cp -rL`` first).

Both ``load_hf`` (:mod:`shardspec.runtime.hf`, which reads the bytes) and ``shardspec
hf-manifest`` (:mod:`shardspec.inputs.hfmanifest`, which reads the headers) apply it.
Pure Python: no torch, no pydantic.
"""

from __future__ import annotations

import os
import re
from enum import Enum

__all__ = ["Escape", "escape", "inside"]

_DRIVE = re.compile(r"^[A-Za-z]:")


class Escape(Enum):
    """Why a name is not a file inside the folder; the value completes ``"file NAME ..."``."""

    NO_NAME = "is not a file name"
    ABSOLUTE = "is an absolute path"
    PARENT = "escapes the directory"
    NOT_PLAIN = "is not a plain relative path (empty, '.' or backslash parts)"
    LINK_OUT = "links outside the directory"


def escape(root: str | os.PathLike[str], name: object) -> Escape | None:
    """Why ``root/name`` is not a file inside ``root``, or None when it is (see the
    module's rule). Only ``LINK_OUT`` looks at the file system."""
    if not isinstance(name, str) or not name:
        return Escape.NO_NAME
    if os.path.isabs(name) or name.startswith(("/", "\\")) or _DRIVE.match(name):
        return Escape.ABSOLUTE
    parts = re.split(r"[\\/]", name)
    if ".." in parts:
        return Escape.PARENT
    if "\\" in name or any(p in ("", ".") for p in parts):
        return Escape.NOT_PLAIN
    real_root = os.path.realpath(root)
    if os.path.commonpath([os.path.realpath(os.path.join(root, name)), real_root]) != real_root:
        return Escape.LINK_OUT
    return None


def inside(root: str | os.PathLike[str], name: object) -> bool:
    """True when ``root/name`` is a file name inside ``root`` (:func:`escape` finds nothing)."""
    return escape(root, name) is None
