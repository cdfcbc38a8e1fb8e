"""What shardspec checks in DCP's ``.metadata`` before anything is read from the data files
it names: its structure is what DCP's ``FileSystemWriter`` writes (:func:`_structure_problem`,
for checkpoints you did not write, :mod:`~shardspec.runtime.checkpoint.trust`), and every
data file it names is a plain file name inside the checkpoint folder, not a link out of it
(:func:`storage_problem`, for every checkpoint: a ``relative_path`` of
``../outside/__0_0.distcp`` would read another folder's bytes). Messages quote values of
the metadata without calling their ``repr`` (:func:`_show`).
"""

from __future__ import annotations

import math
import os
from typing import Any, TypeGuard

import torch

from shardspec.core.paths import Escape, file_escape


def _show(value: Any) -> str:
    """A value of untrusted metadata, for a message: no repr of objects a damaged pickle
    may have built half-way (a dataclass's repr reads fields that may be missing)."""
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        return repr(value if len(value) <= 80 else value[:80] + "...")
    if isinstance(value, torch.Size):
        return str(list(value)) if len(value) <= 8 else f"a torch.Size of {len(value)} dims"
    return f"a {type(value).__name__}"


def _short(e: BaseException, limit: int = 200) -> str:
    text = str(e)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_size(value: Any) -> TypeGuard[torch.Size]:
    return isinstance(value, torch.Size) and all(isinstance(x, int) and x >= 0 for x in value)


def _file_name_problem(name: Any, folder: str | os.PathLike | None = None) -> str | None:
    """What is wrong with ``name`` as a data file of the checkpoint folder (``folder``: the
    folder, for the link check; None: the name's text only), or None (the rule of
    :func:`shardspec.core.paths.file_escape`)."""
    why = file_escape(folder if folder is not None else "", name)
    if why is None or (folder is None and why is Escape.DATA_LINK_OUT):
        return None
    if why is Escape.NO_NAME:
        return f"a data file named {_show(name)}"
    return (
        f"a data file {_show(name)} that {why.value} (only plain file names inside the "
        "checkpoint folder are read)"
    )


def storage_problem(md: Any, folder: str | os.PathLike) -> str | None:
    """The first data file that ``md``'s storage table names and that is not a plain file
    inside ``folder``, as a message; None. Each file is checked once."""
    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        return "no storage_data table"
    seen: set[Any] = set()
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        try:
            if name in seen:
                continue
            seen.add(name)
        except TypeError:  # unhashable: not a name
            pass
        problem = _file_name_problem(name, folder)
        if problem is not None:
            return f"{_show(getattr(index, 'fqn', None))}: {problem}"
    return None


def coverage_problem(md: Any) -> str | None:
    """The first tensor of ``md`` whose chunks do not tile it (a chunk outside the tensor,
    or chunks whose elements do not add up to the tensor's), as a message; None. A damaged
    offset would otherwise leave part of a tensor unread, and its old values in place."""
    sd = getattr(md, "state_dict_metadata", None)
    if not isinstance(sd, dict):
        return "no state_dict_metadata table"
    for key, entry in sd.items():
        chunks, size = getattr(entry, "chunks", None), getattr(entry, "size", None)
        if chunks is None and size is None:
            continue  # a pickled entry
        if not isinstance(chunks, list) or not _is_size(size):
            return f"{_show(key)}: no chunk list or size"
        total = 0
        for chunk in chunks:
            offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
            if not (
                _is_size(offsets) and _is_size(sizes) and len(offsets) == len(sizes) == len(size)
            ):
                return f"{_show(key)}: a malformed chunk"
            if any(o + n > d for o, n, d in zip(offsets, sizes, size, strict=True)):
                where = f"at {list(offsets)} of {list(sizes)}"
                return f"{_show(key)}: a chunk {where} outside {list(size)}"
            total += math.prod(sizes)
        if total != math.prod(size):
            return f"{_show(key)}: its chunks hold {total} elements, the tensor {math.prod(size)}"
    return None


def _structure_problem(md: Any, folder: str | os.PathLike | None = None) -> str | None:
    """What in ``md`` is not the structure DCP's ``FileSystemWriter`` writes, or None
    (``folder``: the checkpoint's folder, where its data files must be)."""
    from torch.distributed.checkpoint import filesystem, metadata

    if not isinstance(md, metadata.Metadata):
        return f"a {type(md).__name__}, not Metadata"
    sd = getattr(md, "state_dict_metadata", None)
    if not isinstance(sd, dict):
        return "no state_dict_metadata table"
    for key, entry in sd.items():
        if not isinstance(key, str):
            return f"a key {_show(key)} that is not a string"
        if isinstance(entry, metadata.BytesStorageMetadata):
            continue
        if not isinstance(entry, metadata.TensorStorageMetadata):
            return f"{key}: a {type(entry).__name__} entry"
        props = getattr(entry, "properties", None)
        if not isinstance(getattr(props, "dtype", None), torch.dtype):
            return f"{key}: no dtype"
        size = getattr(entry, "size", None)
        if not _is_size(size):
            return f"{key}: size {_show(size)}"
        chunks = getattr(entry, "chunks", None)
        if not isinstance(chunks, list):
            return f"{key}: no chunk list"
        for chunk in chunks:
            offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
            if not isinstance(chunk, metadata.ChunkStorageMetadata) or not (
                _is_size(offsets) and _is_size(sizes) and len(offsets) == len(sizes) == len(size)
            ):
                return f"{key}: a malformed chunk ({_show(chunk)})"
            if any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
                return f"{key}: a chunk at {_show(offsets)} of {_show(sizes)} outside {list(size)}"
    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        return "no storage_data table"
    for index, info in storage.items():
        if not isinstance(index, metadata.MetadataIndex) or not isinstance(
            getattr(index, "fqn", None), str
        ):
            return f"a storage key {_show(index)}"
        if not isinstance(info, filesystem._StorageInfo):
            return f"{index.fqn}: storage {type(info).__name__}"
        problem = _file_name_problem(getattr(info, "relative_path", None), folder)
        if problem is not None:
            return f"{index.fqn}: {problem}"
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(offset, int) and isinstance(length, int)) or offset < 0 or length < 0:
            return f"{index.fqn}: bytes at {_show(offset)}, {_show(length)} long"
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and not (
            isinstance(descriptors, (list, tuple)) and all(isinstance(d, str) for d in descriptors)
        ):
            return f"{index.fqn}: transform descriptors {_show(descriptors)}"
        checksum = vars(info).get("checksum")
        if checksum is not None and not isinstance(checksum, str):
            return f"{index.fqn}: a checksum {_show(checksum)}"
    meta = getattr(md, "storage_meta", None)
    if meta is not None and not isinstance(meta, metadata.StorageMeta):
        return f"storage_meta is a {type(meta).__name__}"
    version = getattr(md, "version", None)
    if version is not None and not isinstance(version, str):
        return f"version {_show(version)}"
    return None
