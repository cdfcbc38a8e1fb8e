"""export_hf's folders: the crash-proof protocol of checkpoints
(:class:`~shardspec.runtime.checkpoint.folders.Protocol`) with export_hf's own markers,
sequenced across the ranks of an export (:class:`ExportSession`).

The steps, run by rank 0 where one rank acts (the README's "Loading and exporting Hugging
Face checkpoints" has the table of what each kill point leaves, and what the next
export_hf does about it):

1. finish or undo what an interrupted export of ``path`` left (reported as an
   :class:`ExportRecoveryWarning` on every rank and in the report's ``recovered``), check
   ``path`` (``overwrite``), then create ``<path>.partial`` with the in-progress marker
   :data:`EXPORT_MARKER`;
2. every writing rank writes its safetensors file there (a temporary name, then renamed;
   the file gets the mode a new file gets under the process's umask, as config.json does);
3. write the index and ``config.json``, the completion marker :data:`EXPORT_DONE` (it
   stays in the export), remove the in-progress marker, mark the export at ``path`` as set
   aside (:data:`EXPORT_REPLACED`) and rename it to ``<path>.replaced``, rename
   ``<path>.partial`` to ``path``, remove ``<path>.replaced``;
4. every rank receives rank 0's outcome.

Every collective of an export (its agreements, and the chunk exchange of
:mod:`~shardspec.runtime.hf.exchange`) runs on the export's process group, by default
shardspec's own gloo checkpoint group: when one fails on a rank (a peer died, or gave up),
that rank destroys the group before it raises (:meth:`ExportSession.discard`), so no
survivor waits on it (:mod:`shardspec.runtime.checkpoint.collectives`, "Bounded waits").

Every marker records the inode of the folder it was written into, so export_hf moves or
removes only the folders it made (a user's ``<path>.partial`` or ``<path>.replaced``, even
a copy of an export with its markers, is refused by name, never removed), and
``overwrite=True`` replaces only an earlier export (a folder with :data:`EXPORT_DONE`), never
a file, a link's file, or a folder export_hf did not write. A ``path`` that is a symbolic
link is followed: the export it points to is replaced, and the link stays.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, TypeAlias

import torch
import torch.distributed as dist

from shardspec.runtime.checkpoint.collectives import _distributed, _Roll, _who
from shardspec.runtime.checkpoint.failures import _clear_frames, _line
from shardspec.runtime.checkpoint.folders import (
    Folder,
    Protocol,
    _owned,
    _point,
    _report,
    target,
)
from shardspec.runtime.hf.common import EXPORT_MARKER, INDEX, HFError

__all__ = [
    "EXPORT",
    "EXPORT_DONE",
    "EXPORT_MARKER",
    "EXPORT_REPLACED",
    "ExportRecoveryWarning",
    "ExportSession",
    "target",
]

# A complete export: written into ``<path>.partial`` after every file, the index and the
# config, before it moves into place; it stays in the export (overwrite=True replaces
# only a folder that has it).
EXPORT_DONE = ".shardspec-export.json"

# Written into the export at ``path`` just before export_hf renames it to
# ``<path>.replaced``: only such a folder is ever restored or removed.
EXPORT_REPLACED = ".shardspec-export-replaced"

EXPORT = Protocol(
    actor="export_hf",
    work="an export",
    nothing="nothing was written",
    kind="export",
    saving=EXPORT_MARKER,
    done=EXPORT_DONE,
    aside=EXPORT_REPLACED,
    aside_suffix=".replaced",
    payload=None,
    replaces=frozenset({Folder.EMPTY, Folder.COMPLETE}),
    not_kind=f"no {EXPORT_DONE}: export_hf replaces only a folder it exported",
    error=HFError,
)


# Every rank's value of one collective step, in rank order (ExportSession.gather).
Gather: TypeAlias = Callable[[Any], list[Any]]


class ExportRecoveryWarning(UserWarning):
    """export_hf finished or undid what an interrupted export to the same path left."""


def _file_mode() -> int:
    """The mode a new file gets: 0o666 less the process's umask (read from /proc where it
    can be; else set and put back at once)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _prepare(path: str, overwrite: bool) -> list[str]:
    """Rank 0, before anything is sent: recover, check ``path``, make ``<path>.partial``.
    Without ``overwrite``, a ``path`` that exists is refused before anything is done; a
    missing one may be filled by recovery with the export an interrupted export_hf to it
    completed, which this one then replaces (its own unfinished work), but not with an
    export it restores from ``<path>.replaced``."""
    if os.path.lexists(path) and (os.path.islink(path) or not os.path.isdir(path)):
        _refuse(path, "a file, not a folder")
    if os.path.lexists(path) and not overwrite:
        raise HFError(f"{path} exists; pass overwrite=True to replace it")
    partial = EXPORT.partial(path)
    finishing = EXPORT.state(partial) == Folder.COMPLETE and _owned(partial, EXPORT_DONE)
    done = EXPORT.recover(path)
    state = EXPORT.state(path)
    if state not in (Folder.MISSING, *EXPORT.replaces):
        _refuse(path, "a folder export_hf did not write")
    if state != Folder.MISSING and not overwrite and not finishing:
        raise HFError(f"{path} exists ({'; '.join(done)}); pass overwrite=True to replace it")
    return done + EXPORT.prepare(path, {"format": "shardspec-export-in-progress/1"})


def _refuse(path: str, what: str) -> None:
    raise HFError(
        f"{path} exists and is {what} (no {EXPORT_DONE} in it); nothing was written: "
        "export elsewhere, or move it away (overwrite=True replaces only an earlier export "
        "of export_hf)"
    )


class ExportSession:
    """One export_hf call's protocol steps on one rank: rank 0 acts, every rank agrees
    (:meth:`agree`), and a failed collective becomes an :class:`HFError` that says what
    ``path`` holds and names the rank that stopped where the job's store knows
    (:meth:`lost`), after which :meth:`discard` lets the group go.

    ``group``: the export's process group (None: one process), held by the session's roll
    only, so that nothing else keeps it alive once it is destroyed."""

    def __init__(self, path: str, rank: int, group: Any) -> None:
        self.path = path
        self.partial = EXPORT.partial(path)
        self.rank = rank
        self.step = "planning"
        self.finished = False  # rank 0 moved the new export into place
        self.roll = _Roll(group)
        self.world = dist.get_world_size(group) if _distributed(group) else 1
        self.roll.start()

    @property
    def group(self) -> Any:
        return self.roll.group

    def close(self) -> None:
        self.roll.close()

    def discard(self) -> None:
        """After a failed collective, once the failed frames are emptied
        (:meth:`lost`): destroy the group if it is shardspec's own, so that no rank waits
        on this one (:meth:`~shardspec.runtime.checkpoint.collectives._Roll.discard`)."""
        self.roll.discard()

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, over the export's group."""
        if not _distributed(self.group):
            return [value]
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, value, group=self.group)
        return every

    def prepare(self, overwrite: bool, error: str | None = None) -> list[str]:
        """Step 1 (rank 0), agreed by every rank: what recovery did, reported here.
        ``error``: this rank's own, before it (its config unreadable, its messages not
        staged): every rank raises it, and rank 0, if it is its own, does not prepare."""
        self.step = "preparing"
        mine: tuple[str | None, Any] = (
            (error, None)
            if error is not None
            else attempt_value(lambda: _prepare(self.path, overwrite))
            if self.rank == 0
            else (None, [])
        )
        recovered = self.agree(*mine)
        _report(list(recovered), ExportRecoveryWarning)
        _point("prepared")
        self.step = "sending and writing"
        return list(recovered)

    def write(self, tensors: dict[str, torch.Tensor], name: str) -> None:
        """Step 2: this rank's file, under a temporary name first."""
        from safetensors.torch import save_file

        tmp = os.path.join(self.partial, name + ".tmp")
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.chmod(tmp, _file_mode())  # safetensors writes 0600: a file as any other
        _point("writing")
        os.replace(tmp, os.path.join(self.partial, name))

    def written(self, error: str | None) -> None:
        """After step 2, every rank: all wrote their files, or all raise (rank 0 removes
        the unfinished ``<path>.partial``)."""
        self.agree(error, None)
        _point("written")
        self.step = "finishing"

    def finish(self, index: dict[str, Any], write_config: Callable[[str], None]) -> None:
        """Step 3 (rank 0): the index and the config, then mark complete and move into
        place. A failure after the marking says what is where, and leaves the complete
        export for the next export_hf to move into place."""
        with open(os.path.join(self.partial, INDEX), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
        write_config(self.partial)
        try:
            EXPORT.commit(self.path, {"format": "shardspec-export/1"})
        except OSError as e:
            if EXPORT.state(self.partial) != Folder.COMPLETE:
                raise
            raise HFError(
                f"{type(e).__name__}: {e}; the new export is complete in {self.partial}, "
                f"and the next export_hf to {self.path} moves it into place"
            ) from None
        self.finished = True

    def finished_by_rank0(self, error: str | None) -> None:
        """Step 4, every rank: rank 0's outcome."""
        self.agree(error, None)
        self.roll.done()

    def agree(self, error: str | None, value: Any) -> Any:
        """Share every rank's ``(error, value)``; rank 0's value, or, if any rank failed,
        an :class:`HFError` on every rank listing them (rank 0 first removes an unfinished
        ``<path>.partial`` of its own), so no rank waits for one that gave up."""
        every = self.gather((error, value))
        failed = [(r, e) for r, (e, _) in enumerate(every) if e is not None]
        if not failed:
            return every[0][1]
        if self.rank == 0:
            EXPORT.discard(self.path)
        lines = "\n  ".join(f"rank {r}: {e}" for r, e in failed)
        if self.step == "finishing":
            raise HFError(f"export to {self.path} failed while finishing:\n  {lines}")
        raise HFError(f"export to {self.path} failed; nothing was written there:\n  {lines}")

    def lost(self, e: BaseException) -> HFError:
        """The error for a collective that failed (``e``, the backend's: a rank died or a
        link broke): which rank stopped, and what ``path`` holds."""
        _clear_frames(e)
        asked = bool(self.roll.ranks)  # a store to ask: the job is distributed
        who = _who(self.roll.stopped(), asked)
        if self.step == "planning":
            held = f"{self.path} is unchanged; nothing was written"
        elif self.step != "finishing":
            if self.rank == 0:
                EXPORT.discard(self.path)
                held = f"{self.path} is unchanged, and {self.partial} is removed"
            else:
                held = (
                    f"{self.path} is unchanged; a leftover {self.partial} is removed by "
                    "rank 0, or by the next export_hf"
                )
        elif self.finished:
            held = f"the export is complete at {self.path}"
        else:
            held = (
                f"{self.path} holds the new export if rank 0 moved it into place, else the "
                f"previous one; the next export_hf to {self.path} finishes or undoes what "
                'was left (docs/huggingface.md, "Loading and exporting Hugging Face checkpoints")'
            )
        return HFError(
            f"export to {self.path} failed on rank {self.rank} while {self.step}: {who} "
            f"({_line(e)}); {held}"
        )


def attempt_value(step: Callable[[], Any]) -> tuple[str | None, Any]:
    """Run ``step()``: ``(None, its value)``, or ``(its error as text, None)``."""
    try:
        return None, step()
    except Exception as e:  # reported to every rank by ExportSession.agree
        return f"{type(e).__name__}: {e}", None


def attempt(step: Callable[[], Any]) -> str | None:
    """Run ``step()``; its error as text, or None."""
    return attempt_value(step)[0]
