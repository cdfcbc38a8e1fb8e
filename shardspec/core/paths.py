"""The one rule for a file that a Hugging Face checkpoint's index (or the checkpoint
folder's fixed names, ``model.safetensors`` and its index) names: it is a plain relative
path whose folders stay inside the checkpoint folder, symlinks followed.

A plain relative path is ``/``-separated, with no empty, ``.`` or ``..`` part and no
backslash, and is not absolute (``/x``, ``\\x``, ``C:x``). The folders on the way may be
symlinks as long as they resolve inside the checkpoint folder. The file itself may be a
symlink to a file anywhere: a Hugging Face cache snapshot links every file into
``../../blobs``, and the folder's owner made those links. A name cannot reach outside by its
text, and a linked folder cannot lead it out.

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
    LINK_OUT = "is in a folder that links outside the directory"


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
    folder = os.path.realpath(os.path.dirname(os.path.join(root, name)))
    if os.path.commonpath([folder, real_root]) != real_root:
        return Escape.LINK_OUT
    return None


def inside(root: str | os.PathLike[str], name: object) -> bool:
    """True when ``root/name`` is a file name inside ``root`` (:func:`escape` finds nothing)."""
    return escape(root, name) is None
