"""How the ranks of a save or load agree: the coordinator's outcome broadcast to every
rank (:func:`_exchange`), which ranks stopped when a collective failed (:class:`_Roll`,
through the job's rendezvous store), and the gloo process group that saves and
``export_hf`` use by default (:func:`checkpoint_group`).

**Bounded waits.** When a rank dies, the survivors whose collective was with it fail at
once (gloo sees the closed connection), but a survivor waiting on another survivor that
gave up would wait out the process group's timeout. So a survivor whose collective failed
discards shardspec's own checkpoint group (:func:`_discard`): destroyed and dropped,
its connections close, and every rank still waiting on this one fails within a moment.
A process group of the caller's (``save(..., process_group=g)``) is never destroyed: its
own timeout bounds the wait. The checkpoint group's timeout (:data:`COLLECTIVE_TIMEOUT`, or
``checkpoint_group(timeout=...)``) bounds only the wait for a rank that is alive but does
not answer.
"""

from __future__ import annotations

import contextlib
import gc
import json
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shardspec.runtime.checkpoint.failures import _clear_frames, _line
from shardspec.runtime.units import CheckpointError

# ----------------------------------------------------------------------------- groups


# One checkpoint group per default process group: held only as long as the default group
# lives (a module-level strong reference would keep its gloo threads alive after
# destroy_process_group()).
_CHECKPOINT_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# How long a collective of the checkpoint group waits for a rank that is alive but does
# not answer (a slow writer, a stalled file system). A rank that died, or gave up, is
# noticed within seconds whatever this is (the module's "Bounded waits").
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def checkpoint_group(timeout: timedelta | None = None) -> Any:
    """The process group saves and ``export_hf`` use by default: a gloo group over every
    rank, created on first use (a collective: every rank calls it at the same point, as
    every rank calls ``save``) with ``timeout`` (default :data:`COLLECTIVE_TIMEOUT`), and
    kept as long as the default process group, or until a save or export on it fails
    (then the next one makes a new one). Its collectives never mix with the training
    loop's on the default group."""
    if not dist.is_initialized():
        return None  # one process: nothing to coordinate
    world = dist.group.WORLD
    group = _CHECKPOINT_GROUPS.get(world)
    if group is None:
        group = dist.new_group(backend="gloo", timeout=timeout or COLLECTIVE_TIMEOUT)
        _CHECKPOINT_GROUPS[world] = group
    return group


def _discard(group: Any) -> bool:
    """Destroy ``group`` if it is shardspec's own checkpoint group (and forget it), so that
    its connections close once the last reference to it is gone and a peer still waiting
    on this rank fails at once; a group of the caller's is left as it is."""
    if group is None or not dist.is_initialized():
        return False
    world = dist.group.WORLD
    if _CHECKPOINT_GROUPS.get(world) is not group:
        return False
    del _CHECKPOINT_GROUPS[world]
    with contextlib.suppress(Exception):
        dist.destroy_process_group(group)
    return True


def _distributed(group: Any) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def _coordinator(group: Any) -> bool:
    """DCP's coordinator: rank 0 of the process group."""
    return not dist.is_initialized() or dist.get_rank(group) == 0


def _rank0() -> bool:
    """Rank 0 of the job (or a single process)."""
    return not dist.is_initialized() or dist.get_rank() == 0


# ----------------------------------------------------------------------------- collectives


class _Roll:
    """The process group of one save (or export), and which of its ranks are still alive
    when one of its collectives fails. Each rank posts under keys of this save in the
    job's rendezvous store (not a process group, so a dead peer does not block it): its
    state (``in``, ``failed`` once a collective failed, ``done``) and, from a background
    thread while the save runs, a heartbeat counter every second. The first survivor
    whose collective failed reads every rank's counter twice, 2.5 s apart: a rank whose
    counter stood still and that is neither ``done`` nor ``failed`` has stopped. It posts
    the list (``stopped``), which later survivors read instead of waiting again. A rank
    blocked in a collective (waiting for a dead peer, or for a survivor that gave up)
    still beats, so it is not blamed. Unknown (None) where the store cannot be reached
    (its host may be the rank that died).

    ``group`` is held here only (never in a local of the save's frames, which a raised
    error keeps alive), so that :meth:`discard` can let it go."""

    _count = 0
    interval = 1.0

    def __init__(self, group: Any) -> None:
        _Roll._count += 1  # saves start in the same order on every rank
        self.count = _Roll._count
        self.prefix = f"shardspec/save/{self.count}/"
        self.group = group
        self.store: Any = None
        self.ranks: list[int] = []
        self.rank = 0
        self.failed = False  # one of this save's collectives failed on this rank
        self.known: list[int] | None = None
        self._stop = threading.Event()
        if not _distributed(group):
            return
        try:
            self.store = dist.distributed_c10d._get_default_store()
            self.rank = dist.get_rank()
            self.ranks = sorted(dist.get_process_group_ranks(group or dist.group.WORLD))
        except Exception:  # a torch without these: the failed rank stays unnamed
            self.store = None

    def start(self) -> None:
        """At the start of the save (in the thread that runs it)."""
        if self.store is None:
            return
        if self.count > 1:  # the previous save's keys: three per rank in the store at most
            for key in ("", "/beat"):
                with contextlib.suppress(Exception):
                    self.store.delete_key(f"shardspec/save/{self.count - 1}/{self.rank}{key}")
            if self.rank == 0:
                with contextlib.suppress(Exception):
                    self.store.delete_key(f"shardspec/save/{self.count - 1}/stopped")
        self._post("in")
        threading.Thread(target=self._beat, name="shardspec-save-beat", daemon=True).start()

    def _beat(self) -> None:
        store, key = self.store, f"{self.prefix}{self.rank}/beat"
        while store is not None and not self._stop.is_set():
            try:
                store.add(key, 1)
            except Exception:
                return
            self._stop.wait(self.interval)

    def close(self) -> None:
        self._stop.set()

    def _post(self, state: str) -> None:
        if self.store is not None:
            try:
                self.store.set(self.prefix + str(self.rank), state)
            except Exception:
                self.store = None

    def done(self) -> None:
        self._post("done")

    def _state(self, r: int) -> bytes:
        key = self.prefix + str(r)
        return bytes(self.store.get(key)) if self.store.check([key]) else b""

    def stopped(self) -> list[int] | None:
        """The ranks that stopped (after posting ``failed`` for this one): the list another
        survivor posted, or found here and posted."""
        self._post("failed")
        self.failed = True
        if self.store is None:
            return None
        key = self.prefix + "stopped"
        try:
            if self.store.check([key]):
                self.known = [int(r) for r in json.loads(self.store.get(key))]
                return self.known
            before = {r: self.store.add(f"{self.prefix}{r}/beat", 0) for r in self.ranks}
            time.sleep(2.5 * self.interval)
            silent = [
                r
                for r in self.ranks
                if self._state(r) not in (b"done", b"failed")
                and self.store.add(f"{self.prefix}{r}/beat", 0) == before[r]
            ]
            if silent:
                self.store.set(key, json.dumps(silent))
            self.known = silent
            return silent
        except Exception:
            return None

    def discard(self) -> None:
        """After a failed collective, once the save's frames are gone: destroy the group if
        it is shardspec's own (:func:`_discard`), so that no peer waits on this rank, and
        (rank 0 of the job, which usually hosts the store) wait a few seconds until every
        other rank has said how its save ended, so that the survivors that fail after
        this one can still read the store and name the rank that stopped."""
        if _discard(self.group):
            self.group = None
            gc.collect()  # any cycle still holding it: its connections close now
        if self.store is None or self.rank != 0:
            return
        known = set(self.known or [])
        deadline = time.monotonic() + 4 * self.interval + 4.0
        while time.monotonic() < deadline:
            try:
                if all(
                    r == self.rank or r in known or self._state(r) in (b"done", b"failed")
                    for r in self.ranks
                ):
                    return
            except Exception:
                return
            time.sleep(0.1)


def _exchange(group: Any, value: Any, failed: str, roll: _Roll | None = None) -> Any:
    """Broadcast the coordinator's ``value`` (an outcome: ``("ok", x)`` or ``("error",
    message)``) to every rank of ``group``; raise the error everywhere. A failed collective
    (a rank that died) becomes a :class:`CheckpointError` starting with ``failed``."""
    if _distributed(group):
        box = [value]
        src = 0 if group is None else dist.get_global_rank(group, 0)
        try:
            dist.broadcast_object_list(box, src=src, group=group)
        except Exception as e:  # a peer died or timed out: gloo's RuntimeError
            raise _lost(e, failed, roll) from None
        value = box[0]
    kind, payload = value
    if kind == "error":
        raise CheckpointError(payload)
    return payload


def _lost(e: BaseException, failed: str, roll: _Roll | None) -> CheckpointError:
    """The error for a collective that failed (``e``: the backend's error: a rank died or
    timed out), naming the ranks that stopped where ``roll`` knows."""
    _clear_frames(e)
    stopped = roll.stopped() if roll is not None else None
    return CheckpointError(f"{failed}: {_who(stopped, roll is not None)} ({_line(e)})")


def _who(stopped: list[int] | None, asked: bool) -> str:
    """Which rank stopped, for an error: ``stopped`` as :meth:`_Roll.stopped` found it
    (``asked``: a roll was there to ask)."""
    if stopped:
        return f"rank(s) {stopped} stopped responding"
    if stopped is None and asked:
        return (
            "a rank stopped responding (which one is unknown: the job's store is "
            "unreachable, so its host, usually rank 0, may be the one that stopped)"
        )
    if stopped is None:
        return "a rank stopped responding"
    return "a collective failed although every rank is alive (a timeout?)"


def _outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return ("ok", fn(*args))
    except CheckpointError as e:
        return ("error", str(e))
    except OSError as e:
        return ("error", f"{type(e).__name__}: {e}")
