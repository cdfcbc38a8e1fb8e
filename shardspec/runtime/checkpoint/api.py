"""``save``, ``load`` and ``wait_for_saves``: DCP's ``dcp.save``/``dcp.load`` with the
planners of :mod:`~shardspec.runtime.checkpoint.planners`, made atomic by the folder
protocol (:mod:`~shardspec.runtime.checkpoint.folders`, sequenced across ranks by
:mod:`~shardspec.runtime.checkpoint.collectives`), verified by checksums
(:mod:`~shardspec.runtime.checkpoint.integrity`), within a trust boundary on request
(:mod:`~shardspec.runtime.checkpoint.trust`), and file-local where the checkpoint was
saved on this mesh (:mod:`~shardspec.runtime.checkpoint.locality`). Asynchronous saves run
in one background thread, in the order they were started.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shardspec.runtime.checkpoint.collectives import (
    _coordinator,
    _distributed,
    _exchange,
    _lost,
    _outcome,
    _rank0,
    _Roll,
    checkpoint_group,
)
from shardspec.runtime.checkpoint.failures import _clear_frames, _failure
from shardspec.runtime.checkpoint.folders import (
    CHECKPOINT,
    Folder,
    _commit,
    _folder_state,
    _point,
    _prepare,
    _read_marker,
    _recover,
    _refuse_unfinished,
    _report,
    target,
)
from shardspec.runtime.checkpoint.integrity import (
    METADATA_CHECKSUM,
    ChecksumError,
    ChecksumReader,
    ChecksumWriter,
    file_checksum,
)
from shardspec.runtime.checkpoint.locality import LocalityLoadPlanner
from shardspec.runtime.checkpoint.planners import (
    ShardspecLoadPlanner,
    ShardspecSavePlanner,
    _no_gc,
)
from shardspec.runtime.checkpoint.staging import reader_fills_sinks
from shardspec.runtime.checkpoint.trust import SafeChecksumReader
from shardspec.runtime.spec import CompiledSpec
from shardspec.runtime.units import CheckpointError, KeyLayout

# ----------------------------------------------------------------------------- async


_EXECUTOR: Any = None
_PENDING: weakref.WeakSet = weakref.WeakSet()


def _executor() -> Any:
    """One thread writes every asynchronous save, in the order they were started: the
    saves' collectives (on one process group) run in the same order on every rank."""
    global _EXECUTOR
    if _EXECUTOR is None:
        from concurrent.futures import ThreadPoolExecutor

        _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardspec-save")
    return _EXECUTOR


def wait_for_saves() -> None:
    """Wait until this process's asynchronous saves have finished (their errors stay with
    their futures). ``save`` and ``load`` call it first."""
    for future in list(_PENDING):
        try:
            future.exception()
        except BaseException:  # cancelled
            pass


# ----------------------------------------------------------------------------- save


def save(
    spec: CompiledSpec,
    state: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    mesh: Any = None,
    planner: ShardspecSavePlanner | None = None,
    process_group: Any = None,
    asynchronous: bool = False,
    strict: bool = True,
    keys: str | KeyLayout | None = None,
) -> Any:
    """Save ``state`` to ``path`` so that ``path`` always holds a complete checkpoint: the
    previous one or the new one, never a mix (see the README's "Checkpoints").

    Steps: (1) the coordinator (rank 0 of the process group) finishes or undoes what an
    interrupted save of ``path`` left (:func:`_recover`, reported as a
    :class:`CheckpointRecoveryWarning` on every rank and in the planner's ``recovered``)
    and creates ``<path>.partial`` with an in-progress marker; (2) ``dcp.save`` writes it
    (the structure check runs in DCP's plan exchange); (3) the coordinator writes the
    completion marker ``.shardspec.json``, removes the in-progress marker, renames
    ``path`` to ``<path>.old``, ``<path>.partial`` to ``path``, and removes
    ``<path>.old``; (4) every rank receives the coordinator's outcome, then a barrier on the
    process group (a rank that died after writing its data fails it on every survivor). A
    failure at any step is a :class:`CheckpointError` on every surviving rank.

    Every stored item's checksum is kept in the checkpoint's ``.metadata``
    (:class:`~shardspec.runtime.checkpoint.integrity.ChecksumWriter`); :func:`load` verifies
    them, and
    plain ``dcp.load`` reads the checkpoint as any other.

    ``process_group``: the group DCP and the protocol use (every rank of the job, in rank
    order); default :func:`checkpoint_group`, shardspec's own gloo group. When a rank dies,
    a survivor whose collective failed destroys that group (never one of yours), so no
    survivor waits out a timeout for another that gave up; each names the rank that stopped
    where the job's store knows it.

    ``path``: a symbolic link is followed (:func:`~shardspec.runtime.checkpoint.folders.target`):
    the checkpoint it points to is replaced, beside it, and the link stays as it is.

    ``asynchronous=True`` plans this rank's part and copies what it writes to CPU memory
    (pinned from CUDA) before returning, so training may change the parameters at once;
    the rest runs in a background thread on the process group (never the default group,
    unless given). Returns a :class:`concurrent.futures.Future` (like ``dcp.async_save``):
    ``result()`` waits until the checkpoint is complete at ``path`` and returns the planner,
    or raises the save's :class:`CheckpointError`. Otherwise returns the planner.

    ``strict`` (for the planner made here; a given planner keeps its own): a tensor of the
    model's state that no rule, ignore or buffer of the manifest covers (a key a state-dict
    hook writes in place of a parameter, say) fails the save on every rank before a byte
    is written; ``strict=False`` saves it whole, as DCP does, with an
    :class:`UncoveredEntriesWarning`.

    ``keys`` (for the planner made here): the checkpoint keys of another trainer, so that
    it reads the checkpoint as its own: ``"torchtitan"`` stores a fused parameter that the
    model's state-dict hooks split (``qkv_linear.wqkv.weight``) as the hooks present it
    (``qkv_linear.wq.weight``, ``wk``, ``wv``), and every other fused tensor (optimizer
    state included) whole under its parameter's name, as torchtitan's checkpointer does;
    the hooks' keys in ``model.state_dict()`` are then covered, not refused. None (or
    ``"shardspec"``): shardspec's own layout (components under ``<fqn>.<component>``).
    Load with the same ``keys``."""
    path = target(path)
    planner = planner or ShardspecSavePlanner(spec, mesh, strict=strict, keys=keys)
    if not asynchronous:
        wait_for_saves()
        with _no_gc():  # the group lives in the roll only (see _Roll)
            return _save(spec, state, path, planner, _Roll(_group(process_group)))
    group = _group(process_group)
    try:
        planner.stage(state)
    except CheckpointError as e:
        _clear_frames(e)
        raise
    future = _executor().submit(_save_staged, spec, path, planner, _Roll(group))
    _PENDING.add(future)
    return future


def _group(process_group: Any) -> Any:
    return process_group if process_group is not None else checkpoint_group()


def _save_staged(
    spec: CompiledSpec, path: str, planner: ShardspecSavePlanner, roll: _Roll
) -> ShardspecSavePlanner:
    """An asynchronous save, in the background thread (the planner staged its part)."""
    try:
        return _save(spec, {}, path, planner, roll)
    finally:
        planner.release_staging()


def _save(
    spec: CompiledSpec,
    state: Mapping[str, Any],
    path: str,
    planner: ShardspecSavePlanner,
    roll: _Roll,
) -> ShardspecSavePlanner:
    """:func:`save`'s steps, in the caller's thread or the background one. When one of
    its collectives failed on this rank, the finished frames (which held the process group)
    are emptied and the group is let go (:meth:`_Roll.discard`) before the error leaves."""
    roll.start()
    try:
        return _save_steps(spec, state, path, planner, roll)
    except CheckpointError as e:
        if roll.failed:
            _clear_frames(e)
            roll.discard()
        raise
    finally:
        roll.close()


def _save_steps(
    spec: CompiledSpec,
    state: Mapping[str, Any],
    path: str,
    planner: ShardspecSavePlanner,
    roll: _Roll,
) -> ShardspecSavePlanner:
    tmp = path + ".partial"
    lead = _coordinator(roll.group)
    planner.recovered = _exchange(
        roll.group,
        _outcome(_prepare, path) if lead else None,
        f"saving {path} failed while preparing (before any data was written; {path} is unchanged)",
        roll,
    )
    _report(planner.recovered)
    _point("prepared")
    error: CheckpointError | None = None
    try:
        dcp.save(
            state,
            storage_writer=ChecksumWriter(tmp),
            planner=planner,
            process_group=roll.group,
        )
    except CheckpointException as e:  # DCP's (a BaseException): every rank raises it
        ranks = sorted(getattr(e, "failures", {}) or [])
        where = f" on rank(s) {ranks}" if ranks else ""
        error = _failure(
            e,
            f"saving {path} failed{where}: {path} is unchanged, and the unfinished save "
            f"in {tmp} is removed",
        )
        if lead:  # every rank is past writing: nothing will land in the folder any more
            with contextlib.suppress(OSError):
                CHECKPOINT.discard(path)
        # Every rank raised DCP's exception, so every rank is here: when any rank raises,
        # the unfinished folder is gone (a caller may look, or save again, at once).
        if _distributed(roll.group):
            with contextlib.suppress(Exception):
                dist.barrier(group=roll.group)
    except Exception as e:  # the backend's: a rank died or timed out in DCP's collectives
        error = _lost(
            e,
            f"saving {path} failed while writing ({path} is unchanged, and {tmp} is an "
            "unfinished save, which the next save removes)",
            roll,
        )
    if error is not None:  # raised here, out of the except clause: no context chained
        try:
            raise error
        finally:  # the traceback holds this frame: no cycle back through a local
            error = None
    _point("written")
    outcome = _outcome(_complete, path, spec, planner) if lead else None
    _exchange(
        roll.group,
        outcome,
        f"saving {path} completed (the new checkpoint is complete at {path}), but not every "
        "rank heard of it"
        if outcome is not None and outcome[0] == "ok"
        else f"saving {path} failed after writing its data: {path} holds the new checkpoint "
        f"if rank 0 moved it into place, else the previous one, and the next save or load "
        f"of {path} completes the move (docs/checkpoints.md)",
        roll,
    )
    if _distributed(roll.group):  # every rank is still there at the end, or every survivor says
        try:
            dist.barrier(group=roll.group)
        except Exception as e:
            raise _lost(
                e,
                f"saving {path} completed (the new checkpoint is complete at {path}), but "
                "the save's final barrier failed",
                roll,
            ) from None
    roll.done()
    return planner


# ----------------------------------------------------------------------------- load


def load(
    spec: CompiledSpec,
    state: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    mesh: Any = None,
    partial: bool = False,
    locality: bool = True,
    storage_reader: Any = None,
    atomic: bool = True,
    verify: bool = True,
    trusted: bool = True,
    keys: str | KeyLayout | None = None,
) -> ShardspecLoadPlanner:
    """Load ``path`` into ``state`` in place. Validates everything before reading, reads
    into staging buffers, and changes the live tensors only after every rank's reads
    succeeded: a failed load leaves the model as it was.

    First, rank 0 finishes or undoes what an interrupted save of ``path`` left (see
    :func:`save`; reported as a :class:`CheckpointRecoveryWarning` and in the planner's
    ``recovered``). A folder that a shardspec save has not marked complete (the in-progress
    marker, or a ``.partial`` name) is refused; a DCP checkpoint without shardspec's marker
    (written by ``dcp.save``) loads.

    With ``locality`` (the default), a checkpoint saved on this very mesh with this very
    structure is read file-locally: each rank opens only the files it wrote, and replicas
    receive their copies from the writer (see :mod:`shardspec.runtime.checkpoint.locality`).

    ``atomic=False`` trades the guarantee for speed: after the same validation, DCP reads
    straight into the live tensors (no staging memory, no file locality), as fast as the
    planner alone. A read that fails then (a file truncated or removed after validation, an
    I/O error) leaves the tensors it had reached loaded and the others as they were.

    Every stored item is checked against the checksum ``save`` wrote for it
    (:mod:`shardspec.runtime.checkpoint.integrity`); a mismatch or a truncated file is a
    :class:`~shardspec.runtime.checkpoint.integrity.ChecksumError` naming the file, the key and the
    chunk, and the model is not changed. ``verify=False`` skips the checks. A checkpoint
    without checksums (written by ``dcp.save``) loads unverified.

    ``trusted=False`` loads a checkpoint you did not write within a trust boundary
    (:mod:`shardspec.runtime.checkpoint.trust`): ``.metadata`` through an allowlisting
    unpickler, and
    pickled entries checked by torch's ``weights_only`` unpickler before they are parsed.
    ``storage_reader`` replaces the reader (``verify`` and ``trusted`` then do nothing).

    Whatever the trust, ``.metadata`` must match the checksum its save recorded (unless
    ``verify=False``), and every data file it names must be a plain file inside the
    folder; a failure is one line naming ``.metadata``. ``path``: a symbolic link is
    followed, as by :func:`save`. ``keys``: the key layout the checkpoint was saved with
    (see :func:`save`; ``"torchtitan"`` reads torchtitan's own checkpoints)."""
    path = target(path)
    wait_for_saves()
    recovered = _exchange(
        None,
        _outcome(_recover, path) if _rank0() else None,
        f"loading {path} failed while checking for an interrupted save",
    )
    _report(recovered)
    _refuse_unfinished(path)
    meta = os.path.join(path, ".metadata")
    if not os.path.isfile(meta):
        unfinished = _folder_state(path + ".partial") is Folder.SAVING
        more = f" ({path}.partial is an unfinished save)" if unfinished else ""
        raise CheckpointError(f"{meta} is missing: {path} is not a complete DCP checkpoint{more}")
    marker = _read_marker(path) if locality and atomic else None
    planner: ShardspecLoadPlanner
    if not atomic:
        planner = ShardspecLoadPlanner(spec, mesh, partial=partial, staging=False, keys=keys)
    elif marker is not None:
        planner = LocalityLoadPlanner(spec, mesh, marker=marker, partial=partial, keys=keys)
    else:
        planner = ShardspecLoadPlanner(spec, mesh, partial=partial, staging=True, keys=keys)
    reader = storage_reader if storage_reader is not None else _reader(path, verify, trusted)
    planner.capture = reader_fills_sinks(reader)
    error: CheckpointError | None = None
    try:
        with _no_gc():
            dcp.load(state, storage_reader=reader, planner=planner)
        if isinstance(planner, LocalityLoadPlanner):  # replicas' chunks come from their writer
            planner.exchange()
    except CheckpointError as e:  # ours, raised after DCP (the exchange): as it is
        _clear_frames(e)
        raise
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException: name it all
        state_of = "the model was not changed" if atomic else "the model may be partly loaded"
        refused = getattr(reader, "metadata_error", None)
        if isinstance(refused, CheckpointError):  # DCP buried it in an assertion of its own
            _clear_frames(e)
            error = type(refused)(f"{refused}; the model was not changed")
        else:
            error = _failure(e, f"reading {path} failed; {state_of}")
        if isinstance(error, ChecksumError) and refused is None:  # the reader's: it cannot
            error = ChecksumError(f"{error}; {state_of}")  # tell atomic from not
    if error is not None:  # raised here, out of the except clause: no context chained
        try:
            raise error
        finally:  # the traceback holds this frame: no cycle back through a local
            error = None
    planner.commit()
    planner.recovered = recovered
    return planner


def _reader(path: str, verify: bool, trusted: bool) -> Any:
    """``load``'s storage reader: DCP's ``FileSystemReader`` that verifies the checksums
    ``save`` stored (:class:`~shardspec.runtime.checkpoint.integrity.ChecksumReader`), within the
    trust boundary of :mod:`shardspec.runtime.checkpoint.trust` unless ``trusted``."""
    if trusted:
        return ChecksumReader(path, verify=verify)
    return SafeChecksumReader(path, verify=verify)


def _complete(path: str, spec: CompiledSpec, planner: ShardspecSavePlanner) -> None:
    """The coordinator, once DCP wrote every rank's data and the ``.metadata``: mark the
    checkpoint complete (with the checksum of its ``.metadata``) and move it into place."""
    marker = _marker(spec, planner)
    marker[METADATA_CHECKSUM] = file_checksum(os.path.join(path + ".partial", ".metadata"))
    _commit(path, marker)


def _marker(spec: CompiledSpec, planner: ShardspecSavePlanner) -> dict[str, Any]:
    """The ``.shardspec.json`` of a complete checkpoint: the spec, the mesh, and the
    structure fingerprint a file-local load (:mod:`shardspec.runtime.checkpoint.locality`) compares
    with its own.

    Pipeline stages hold different structures, so no single fingerprint describes the
    checkpoint: the marker lists each stage's (``stage_fingerprints``) and records no
    ``fingerprint``. With rank 0's fingerprint (stage 0's) there, the first stage's ranks
    chose file-local reads and the others did not, and every load at pp > 1 on the mesh
    it was saved with failed ("ranks disagree on file locality"). Now no rank finds its
    fingerprint there, and every rank reads the checkpoint as on any other mesh."""
    marker: dict[str, Any] = {
        "format": "shardspec-checkpoint/1",
        "spec": spec.name,
        "mesh": dict(zip(planner.lmesh.names, planner.lmesh.sizes, strict=True)),
    }
    if planner.canon.stage is None:
        marker["fingerprint"] = planner.canon.fingerprint
    else:
        stages = planner.stage_fingerprints or {planner.canon.stage: planner.canon.fingerprint}
        marker["stage_fingerprints"] = {str(k): v for k, v in sorted(stages.items())}
    return marker
