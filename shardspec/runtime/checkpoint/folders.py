"""The crash-proof folder protocol on disk, shared by ``save`` (checkpoints, :data:`CHECKPOINT`)
and ``export_hf`` (Hugging Face exports, :mod:`shardspec.runtime.hf.folders`).

A writer fills ``<path>.partial`` (holding an in-progress marker), marks it complete (a
completion marker, which stays in the folder), sets the folder at ``path`` aside as
``<path>.old`` (a set-aside marker written just before the rename; ``<path>.replaced`` for
exports), moves the new folder into place and removes the one set aside. Whatever step a
writer stopped at, :meth:`Protocol.recover` finishes or undoes it, so ``path`` always holds
the previous folder or the new one. The steps run on one rank (the coordinator);
:mod:`~shardspec.runtime.checkpoint.api` and :mod:`shardspec.runtime.hf.export` sequence
them across ranks.

**Ownership.** Every marker records the inode of the folder it was written into. A rename
keeps a folder's inode; a copy (``cp -r``) gets a new one, though it carries the markers.
So a folder is the protocol's own (:func:`_owned`) only when it is a real folder (not a
link) holding a marker whose inode is the folder's own: recovery moves or removes only
such folders, and never a user's ``<path>.partial``, ``<path>.old`` or ``<path>.replaced``,
whatever is inside (a copy of a checkpoint with its markers included). A folder whose
file system does not keep inode numbers across a rename is never proven the protocol's: it
is refused with an error that names it, never removed.

**Links.** :func:`target` follows a ``path`` that is a symbolic link, once, before
anything else: the protocol then works beside the folder the link points to, and the link
itself is never replaced or removed. Siblings that are links are never the protocol's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import warnings
from dataclasses import dataclass
from enum import Enum
from typing import Any

from shardspec.core.jsontext import JSONTextError, read_json
from shardspec.runtime.units import CheckpointError

# A complete checkpoint: written into it (the spec, the mesh, the structure fingerprint, the
# checksum of DCP's .metadata) once every rank's data and DCP's .metadata are there, before
# it moves into place.
MARKER = ".shardspec.json"

# A save in progress: written into ``<path>.partial`` before any data, removed once the
# completion marker is there. A folder that has it is never loaded as a checkpoint.
SAVING = ".shardspec-saving"

# Written into the checkpoint at ``path`` just before a save renames it to ``<path>.old``:
# recovery restores or removes only a ``<path>.old`` that a save set aside, never a user's
# own folder of that name.
REPLACED = ".shardspec-replaced"

# Markers are small JSON files; one larger than this is not the protocol's.
_MARKER_BYTES = 1 << 20

# Test hook: called with the name of each step of the protocol (see Protocol.commit).
_fault_point: Any = None


def _point(name: str) -> None:
    if _fault_point is not None:
        _fault_point(name)


class Folder(str, Enum):
    """What is at a path (equal to its lower-case name as a string)."""

    MISSING = "missing"
    COMPLETE = "complete"  # the completion marker (and, for a checkpoint, DCP's .metadata)
    SAVING = "saving"  # a write in progress or interrupted: the in-progress marker
    FOREIGN = "foreign"  # a DCP checkpoint without shardspec's markers, as dcp.save writes
    EMPTY = "empty"
    OTHER = "other"  # anything else: a file, a link, someone else's folder


def target(path: str | os.PathLike, error: type[Exception] = CheckpointError) -> str:
    """The folder a save, load or export of ``path`` works on: ``path`` without trailing
    separators (``ck/`` is ``ck``, not a folder whose ``.partial`` is inside it) and, when
    ``path`` is a symbolic link, the folder it points to (see the module's "Links")."""
    text = os.fspath(path)
    stripped = text.rstrip("/" + os.sep) or text[:1]
    if not stripped:
        raise error("the path is empty")
    if not os.path.islink(stripped):
        return stripped
    real = os.path.realpath(stripped)
    if os.path.islink(real):
        raise error(f"{stripped} is a symbolic link that does not resolve (a loop); nothing done")
    return real


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


def _stamp(folder: str, name: str, fields: dict[str, Any]) -> None:
    """Write the marker ``name`` into ``folder``: ``fields`` and the folder's inode."""
    _write_json(os.path.join(folder, name), {**fields, "inode": os.lstat(folder).st_ino})


def _owned(folder: str, name: str) -> bool:
    """Whether ``folder`` is a folder (not a link) holding the marker ``name`` that the
    protocol wrote into this very folder: the inode the marker records is the folder's."""
    try:
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or not st.st_ino:
            return False
        mark = os.path.join(folder, name)
        mst = os.lstat(mark)
        if not stat.S_ISREG(mst.st_mode) or mst.st_size > _MARKER_BYTES:
            return False
        with open(mark, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("inode") == st.st_ino


def _parent(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


@dataclass(frozen=True)
class Protocol:
    """The names and words of one use of the protocol: who writes (``actor``), what a
    complete folder is (``kind``), its three markers, the suffix of the folder set aside,
    the file a complete folder holds besides its marker (``payload``, DCP's ``.metadata``),
    which states of ``path`` a new folder may replace, and the error it raises."""

    actor: str  # "save", "export_hf"
    work: str  # "a save", "an export": what is in progress in ``<path>.partial``
    nothing: str  # "nothing was saved": what a refusal leaves
    kind: str  # "checkpoint", "export"
    saving: str
    done: str
    aside: str
    aside_suffix: str
    payload: str | None
    replaces: frozenset[Folder]
    not_kind: str  # why a folder at ``path`` is no ``kind`` the protocol may replace
    error: type[Exception]

    def partial(self, path: str) -> str:
        return path + ".partial"

    def old(self, path: str) -> str:
        return path + self.aside_suffix

    def state(self, path: str) -> Folder:
        """``missing``; ``complete`` (the completion marker, and the payload); ``saving``
        (the in-progress marker, no completion marker); ``foreign`` (the payload without
        markers: a DCP checkpoint as ``dcp.save`` writes it); ``empty``; ``other``
        (anything else, a link or a file included)."""
        if not os.path.lexists(path):
            return Folder.MISSING
        if os.path.islink(path) or not os.path.isdir(path):
            return Folder.OTHER
        names = set(os.listdir(path))
        payload = self.payload is None or self.payload in names
        if self.done in names and payload:
            return Folder.COMPLETE
        if self.saving in names:
            return Folder.SAVING
        if self.done in names:
            return Folder.OTHER
        if self.payload is not None and self.payload in names:
            return Folder.FOREIGN
        return Folder.OTHER if names else Folder.EMPTY

    def _set_aside(self, path: str, old: str) -> None:
        """Mark the folder at ``path`` as set aside by the protocol, and rename it to ``old``."""
        _stamp(path, self.aside, {"set_aside_by": self.actor, "path": os.path.basename(path)})
        try:
            os.rename(path, old)
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(path, self.aside))
            raise

    def recover(self, path: str) -> list[str]:
        """Finish or undo what a write of ``path`` that stopped part-way left (the
        coordinator, before a save or load of ``path``, or an export to it). Returns what
        it did, one sentence each:

        * ``<path>.partial`` complete and the protocol's (stamped), not moved into place:
          moved into place, the folder at ``path`` (set aside, then) removed;
        * ``path`` missing and ``<path>.old`` a folder the protocol set aside: restored;
        * such a ``<path>.old`` beside a complete folder at ``path``: removed.

        Nothing else is moved or removed: a folder that is not provably the protocol's
        (module docstring) is left alone, and a write that needs its name refuses."""
        tmp, old = self.partial(path), self.old(path)
        done: list[str] = []
        here = self.state(path)
        if self.state(tmp) == Folder.COMPLETE and _owned(tmp, self.done):
            if here not in (Folder.MISSING, *self.replaces):
                raise self.error(
                    f"{tmp} holds a complete {self.kind} that {self.actor} did not move into "
                    f"place, but {path} exists and is not a {self.kind}; nothing was changed: "
                    f"move {path} away and retry"
                )
            if here != Folder.MISSING:
                if os.path.lexists(old):
                    if not _owned(old, self.aside):
                        raise self.error(
                            f"{tmp} holds a complete {self.kind} that {self.actor} did not "
                            f"move into place, but {old}, which no {self.actor} set aside, is "
                            "in the way; nothing was changed: move it away and retry"
                        )
                    shutil.rmtree(old)
                self._set_aside(path, old)
            os.rename(tmp, path)
            _fsync_dir(_parent(path))
            done.append(
                f"{tmp} held a complete {self.kind} that its {self.actor} had marked but not "
                f"moved into place: moved it to {path}"
                + (
                    ""
                    if here == Folder.MISSING
                    else f" (the {self.kind} that was there is removed)"
                )
            )
            if _owned(old, self.aside):
                shutil.rmtree(old)
            return done
        if not _owned(old, self.aside):
            return done
        if here == Folder.MISSING:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(old, self.aside))
            os.rename(old, path)
            _fsync_dir(_parent(path))
            done.append(
                f"{path} was missing and {old} held the previous {self.kind} (a {self.actor} "
                f"stopped between its renames): restored it to {path}"
            )
        elif here in self.replaces:
            shutil.rmtree(old)
            done.append(
                f"removed {old}, the previous {self.kind}, which a {self.actor} that moved the "
                f"new one to {path} had not removed yet"
            )
        return done

    def prepare(self, path: str, fields: dict[str, Any]) -> list[str]:
        """The coordinator, before any rank writes: recover what an interrupted write
        left, then create ``<path>.partial`` with the in-progress marker (``fields`` and
        the stamp). Refuses (nothing changed) a ``path``, ``<path>.partial`` or
        ``<path>.old`` that is someone else's."""
        tmp, old = self.partial(path), self.old(path)
        done = self.recover(path)
        here = self.state(path)
        nothing = self.nothing
        if here != Folder.MISSING and here not in self.replaces:
            raise self.error(
                f"{path} exists and is not a {self.kind} ({self.not_kind}); {nothing}: "
                f"write elsewhere or move it away"
            )
        if os.path.lexists(old) and here != Folder.MISSING:
            raise self.error(
                f"{old} exists and no {self.actor} set it aside; {nothing}: move it away "
                f"({self.work} to {path} moves the {self.kind} there while it replaces it)"
            )
        state = self.state(tmp)
        if state == Folder.SAVING and _owned(tmp, self.saving):
            shutil.rmtree(tmp)
            done.append(f"removed {tmp}, an unfinished {self.actor}")
        elif state == Folder.EMPTY:
            os.rmdir(tmp)
        elif state != Folder.MISSING:
            raise self.error(
                f"{tmp} exists and is not {self.work} in progress (no {self.saving} "
                f"marker that {self.actor} wrote into that very folder: a folder of yours, a "
                f"copy, or one an older shardspec left); {nothing}: move it away "
                f"({self.work} to {path} writes there first)"
            )
        os.makedirs(tmp)
        _stamp(tmp, self.saving, {**fields, "path": os.path.basename(path)})
        return done

    def commit(self, path: str, marker: dict[str, Any]) -> None:
        """The coordinator, once every rank's files are in ``<path>.partial``: mark it
        complete (``marker`` and the stamp), then move it into place."""
        tmp, old = self.partial(path), self.old(path)
        _stamp(tmp, self.done, marker)
        os.remove(os.path.join(tmp, self.saving))
        _fsync_dir(tmp)
        _point("marked")
        replacing = os.path.lexists(path)
        if replacing:
            self._set_aside(path, old)  # prepare made sure no other <path>.old is in the way
            _point("renamed-old")
        os.rename(tmp, path)
        _fsync_dir(_parent(path))
        _point("renamed-new")
        if replacing:
            shutil.rmtree(old)

    def discard(self, path: str) -> bool:
        """Remove ``<path>.partial`` if it is an unfinished write of the protocol's (its
        stamped in-progress marker); whether it did."""
        tmp = self.partial(path)
        if self.state(tmp) != Folder.SAVING or not _owned(tmp, self.saving):
            return False
        shutil.rmtree(tmp, ignore_errors=True)
        return True


CHECKPOINT = Protocol(
    actor="save",
    work="a save",
    nothing="nothing was saved",
    kind="checkpoint",
    saving=SAVING,
    done=MARKER,
    aside=REPLACED,
    aside_suffix=".old",
    payload=".metadata",
    replaces=frozenset({Folder.EMPTY, Folder.COMPLETE, Folder.FOREIGN}),
    not_kind="no DCP .metadata",
    error=CheckpointError,
)


def _folder_state(path: str) -> Folder:
    """What is at ``path``, as a checkpoint (:meth:`Protocol.state`)."""
    return CHECKPOINT.state(path)


def _recover(path: str) -> list[str]:
    """:meth:`Protocol.recover` of a checkpoint path."""
    return CHECKPOINT.recover(path)


def _prepare(path: str) -> list[str]:
    """:meth:`Protocol.prepare` of a checkpoint path."""
    return CHECKPOINT.prepare(path, {"format": "shardspec-save-in-progress/1"})


def _commit(path: str, marker: dict[str, Any]) -> None:
    """:meth:`Protocol.commit` of a checkpoint path."""
    CHECKPOINT.commit(path, marker)


def _report(done: list[str], category: type[Warning] | None = None) -> None:
    for line in done:
        warnings.warn(line, category or CheckpointRecoveryWarning, stacklevel=3)


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
    """The checkpoint's ``.shardspec.json``, or None where it has none (a default-planner
    checkpoint). A marker that is there but is no readable JSON object is damaged: a
    one-line :class:`CheckpointError` (it holds the checksum the load verifies against)."""
    file = os.path.join(path, MARKER)
    try:
        marker = read_json(file)
    except FileNotFoundError:
        return None
    except (OSError, JSONTextError) as e:
        why = (e.strerror or str(e)) if isinstance(e, OSError) else str(e)
        raise CheckpointError(f"{file} cannot be read: {why}; nothing was read") from None
    if not isinstance(marker, dict):
        raise CheckpointError(f"{file} is not a JSON object; nothing was read")
    return marker
