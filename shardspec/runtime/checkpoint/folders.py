"""The crash-proof folder protocol on disk: a save writes ``<path>.partial`` (with the
in-progress marker :data:`SAVING`), marks it complete (:data:`MARKER`, the
``.shardspec.json`` a load also reads), sets the previous checkpoint aside as
``<path>.old`` (marked :data:`REPLACED`) and moves the new one into place. Whatever step a
save stopped at, :func:`_recover` finishes or undoes it, so ``path`` always holds a
complete checkpoint. The steps run on the coordinator; :mod:`~shardspec.runtime.checkpoint.api`
sequences them across ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from enum import Enum
from typing import Any

from shardspec.runtime.units import CheckpointError

# A complete checkpoint: written into it (the spec, the mesh, the structure fingerprint)
# once every rank's data and DCP's .metadata are there, before it moves into place.
MARKER = ".shardspec.json"

# A save in progress: written into ``<path>.partial`` before any data, removed once the
# completion marker is there. A folder that has it is never loaded as a checkpoint.
SAVING = ".shardspec-saving"

# Test hook: called with the name of each step of the save protocol (see save()).
_fault_point: Any = None


def _point(name: str) -> None:
    if _fault_point is not None:
        _fault_point(name)


class Folder(str, Enum):
    """What is at a checkpoint path (equal to its lower-case name as a string)."""

    MISSING = "missing"
    COMPLETE = "complete"  # DCP's .metadata and shardspec's completion marker
    SAVING = "saving"  # a shardspec save in progress or interrupted: the in-progress marker
    FOREIGN = "foreign"  # a DCP checkpoint without shardspec's markers, as dcp.save writes
    EMPTY = "empty"
    OTHER = "other"  # anything else


def _folder_state(path: str) -> Folder:
    """``missing``; ``complete`` (DCP's ``.metadata`` and shardspec's completion marker);
    ``saving`` (a shardspec save in progress or interrupted: no completion marker, the
    in-progress marker); ``foreign`` (a DCP checkpoint without shardspec's markers, as
    ``dcp.save`` writes); ``empty``; ``other`` (anything else)."""
    if not os.path.lexists(path):
        return Folder.MISSING
    if not os.path.isdir(path):
        return Folder.OTHER
    names = set(os.listdir(path))
    if MARKER in names and ".metadata" in names:
        return Folder.COMPLETE
    if SAVING in names:
        return Folder.SAVING
    if MARKER in names:
        return Folder.OTHER
    if ".metadata" in names:
        return Folder.FOREIGN
    return Folder.OTHER if names else Folder.EMPTY


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json(path: str, value: Any) -> None:
    """Write ``path`` atomically (a temporary file, fsynced, renamed over it)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# Written into the checkpoint at ``path`` just before a save renames it to ``<path>.old``:
# recovery restores or removes only a ``<path>.old`` that a save set aside (or that is a
# shardspec checkpoint), never a user's own folder of that name.
REPLACED = ".shardspec-replaced"


def _set_aside(path: str, old: str) -> None:
    """Mark the checkpoint at ``path`` as set aside by a save, and rename it to ``old``."""
    with open(os.path.join(path, REPLACED), "w", encoding="utf-8") as f:
        f.write("set aside by a shardspec save; removed when the save completes\n")
    os.rename(path, old)


def _ours_old(old: str) -> bool:
    """Whether ``old`` is a checkpoint that a save set aside (see :data:`REPLACED`)."""
    try:
        names = set(os.listdir(old))
    except OSError:
        return False
    return REPLACED in names or (MARKER in names and ".metadata" in names)


def _recover(path: str) -> list[str]:
    """Finish or undo what a save of ``path`` that stopped part-way left (the coordinator,
    before a save or load of ``path``; see :func:`save` for the steps). Returns what it
    did, one sentence each:

    * ``<path>.partial`` complete (marked) but not moved into place: moved into place,
      the checkpoint that was at ``path`` removed (the save stopped after marking);
    * ``path`` missing and ``<path>.old`` a checkpoint a save set aside: restored (the
      save stopped between its two renames, before the new one was complete);
    * such a ``<path>.old`` beside a checkpoint at ``path``: removed (the save stopped
      after moving the new checkpoint into place).

    A ``<path>.old`` that no save set aside is left alone (and a save that would need its
    name is refused, by :func:`_prepare`)."""
    tmp, old = path + ".partial", path + ".old"
    done: list[str] = []
    here, new = _folder_state(path), _folder_state(tmp)
    checkpoint = (Folder.COMPLETE, Folder.FOREIGN)
    parent = os.path.dirname(os.path.abspath(path))
    if new == Folder.COMPLETE:
        if here not in (Folder.MISSING, Folder.EMPTY, *checkpoint):
            raise CheckpointError(
                f"{tmp} holds a complete checkpoint that a save did not move into place, but "
                f"{path} exists and is not a checkpoint; move {path} away and retry"
            )
        if here != Folder.MISSING:
            if os.path.lexists(old):
                if not _ours_old(old):
                    raise CheckpointError(
                        f"{tmp} holds a complete checkpoint that a save did not move into "
                        f"place, but {old}, which is not a save's, is in the way; move it away "
                        "and retry"
                    )
                shutil.rmtree(old)
            _set_aside(path, old)
        os.rename(tmp, path)
        _fsync_dir(parent)
        done.append(
            f"{tmp} held a complete checkpoint that its save had marked but not moved into "
            f"place: moved it to {path}"
            + ("" if here == Folder.MISSING else " (the checkpoint that was there is removed)")
        )
        if os.path.lexists(old) and _ours_old(old):
            shutil.rmtree(old)
        return done
    if not _ours_old(old):
        return done
    if here == Folder.MISSING and _folder_state(old) in checkpoint:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(old, REPLACED))
        os.rename(old, path)
        _fsync_dir(parent)
        done.append(
            f"{path} was missing and {old} held the previous checkpoint (a save stopped "
            f"between its renames): restored it to {path}"
        )
    elif here in checkpoint:
        shutil.rmtree(old)
        done.append(
            f"removed {old}, the previous checkpoint, which a save that moved the new one to "
            f"{path} had not removed yet"
        )
    return done


def _prepare(path: str) -> list[str]:
    """The coordinator, before any rank writes: recover what an interrupted save left,
    then create ``<path>.partial`` with the in-progress marker. Refuses (nothing changed) a
    ``path``, ``<path>.partial`` or ``<path>.old`` that is someone else's folder."""
    tmp, old = path + ".partial", path + ".old"
    done = _recover(path)
    here = _folder_state(path)
    if here == Folder.OTHER or here == Folder.SAVING:
        raise CheckpointError(
            f"{path} exists and is not a checkpoint (no DCP .metadata); nothing was saved: "
            "save elsewhere or remove it"
        )
    if os.path.lexists(old) and here != Folder.MISSING:
        raise CheckpointError(
            f"{old} exists and no save set it aside; nothing was saved: move it away (a save "
            f"of {path} moves the checkpoint there while it replaces it)"
        )
    state = _folder_state(tmp)
    if state == Folder.SAVING:
        shutil.rmtree(tmp)
        done.append(f"removed {tmp}, an unfinished save")
    elif state == Folder.EMPTY:
        os.rmdir(tmp)
    elif state != Folder.MISSING:
        raise CheckpointError(
            f"{tmp} exists and is not a save in progress by shardspec (no {SAVING} marker); "
            f"nothing was saved: move it away (a save of {path} writes there first)"
        )
    os.makedirs(tmp)
    _write_json(
        os.path.join(tmp, SAVING),
        {"format": "shardspec-save-in-progress/1", "path": os.path.basename(path)},
    )
    return done


def _commit(path: str, marker: dict[str, Any]) -> None:
    """The coordinator, after every rank's data and DCP's ``.metadata`` are written: mark
    ``<path>.partial`` complete, then move it into place."""
    tmp, old = path + ".partial", path + ".old"
    _write_json(os.path.join(tmp, MARKER), marker)
    os.remove(os.path.join(tmp, SAVING))
    _fsync_dir(tmp)
    _point("marked")
    replacing = os.path.lexists(path)
    if replacing:
        _set_aside(path, old)  # _prepare made sure no other <path>.old is in the way
        _point("renamed-old")
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    _point("renamed-new")
    if replacing:
        shutil.rmtree(old)


def _report(done: list[str]) -> None:
    for line in done:
        warnings.warn(line, CheckpointRecoveryWarning, stacklevel=3)


class CheckpointRecoveryWarning(UserWarning):
    """A save or load finished or undid what an interrupted save of the same path left."""


def _refuse_unfinished(path: str) -> None:
    """A folder a shardspec save has not marked complete is never loaded."""
    state = _folder_state(path)
    if state == Folder.SAVING:
        raise CheckpointError(
            f"{path} is an unfinished save (it has the in-progress marker {SAVING} and no "
            f"completion marker {MARKER}); nothing was read"
        )
    if state != Folder.COMPLETE and path.rstrip("/").endswith(".partial"):
        raise CheckpointError(
            f"{path} is not marked complete ({MARKER}): a '.partial' folder is a save that "
            "did not finish; nothing was read"
        )


def _read_marker(path: str) -> dict | None:
    """The checkpoint's ``.shardspec.json``, or None (a default-planner checkpoint)."""
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None
