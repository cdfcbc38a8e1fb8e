"""How the ranks of a save or load agree: the coordinator's outcome broadcast to every
rank (:func:`_exchange`), which ranks stopped when a collective failed (:class:`_Roll`,
through the job's rendezvous store), and the gloo process group that asynchronous saves
use by default (:func:`checkpoint_group`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import torch.distributed as dist

from shardspec.runtime.checkpoint.failures import _clear_frames
from shardspec.runtime.units import CheckpointError

# ----------------------------------------------------------------------------- groups


# One checkpoint group per default process group: held only as long as the default group
# lives (a module-level strong reference would keep its gloo threads alive after
# destroy_process_group()).
_CHECKPOINT_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def checkpoint_group() -> Any:
    """The process group asynchronous saves use by default: a gloo group over every rank,
    created on first use (a collective: every rank calls it at the same point, as every
    rank calls ``save``) and kept as long as the default process group. Its collectives
    never mix with the training loop's on the default group."""
    if not dist.is_initialized():
        return None  # one process: nothing to coordinate
    world = dist.group.WORLD
    group = _CHECKPOINT_GROUPS.get(world)
    if group is None:
        group = dist.new_group(backend="gloo")
        _CHECKPOINT_GROUPS[world] = group
    return group


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
    """Which ranks of a save are still alive when one of its collectives fails. Each rank
    posts under keys of this save in the job's rendezvous store (not a process group, so a
    dead peer does not block it): its state (``in``, ``failed`` once a collective failed,
    ``done``) and, from a background thread while the save runs, a heartbeat counter
    every second. A survivor whose collective failed reads every rank's counter twice,
    2.5 s apart: a rank whose counter stood still and that is neither ``done`` nor
    ``failed`` has stopped. A rank blocked in a collective (waiting for a dead peer, or for
    a survivor that gave up) still beats, so it is not blamed. Unknown (None) where the
    store cannot be reached (its host may be the rank that died)."""

    _count = 0
    interval = 1.0

    def __init__(self, group: Any) -> None:
        _Roll._count += 1  # saves start in the same order on every rank
        self.count = _Roll._count
        self.prefix = f"shardspec/save/{self.count}/"
        self.store: Any = None
        self.ranks: list[int] = []
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
        if self.count > 1:  # the previous save's keys: two per rank in the store at most
            for key in ("", "/beat"):
                with contextlib.suppress(Exception):
                    self.store.delete_key(f"shardspec/save/{self.count - 1}/{self.rank}{key}")
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

    def stopped(self) -> list[int] | None:
        """The ranks that stopped (after posting ``failed`` for this one)."""
        import time

        self._post("failed")
        if self.store is None:
            return None
        try:
            before = {r: self.store.add(f"{self.prefix}{r}/beat", 0) for r in self.ranks}
            time.sleep(2.5 * self.interval)
            silent = []
            for r in self.ranks:
                key = self.prefix + str(r)
                state = self.store.get(key) if self.store.check([key]) else b""
                beats = self.store.add(f"{self.prefix}{r}/beat", 0)
                if state not in (b"done", b"failed") and beats == before[r]:
                    silent.append(r)
            return silent
        except Exception:
            return None


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
    text = str(e).strip()
    first = text.splitlines()[0] if text else repr(e)
    stopped = roll.stopped() if roll is not None else None
    if stopped:
        who = f"rank(s) {stopped} stopped responding"
    elif stopped is None and roll is not None:
        who = (
            "a rank stopped responding (which one is unknown: the job's store is "
            "unreachable, so its host, usually rank 0, may be the one that stopped)"
        )
    elif stopped is None:
        who = "a rank stopped responding"
    else:
        who = "a collective failed although every rank is alive (a timeout?)"
    return CheckpointError(f"{failed}: {who} ({type(e).__name__}: {first})")


def _outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return ("ok", fn(*args))
    except CheckpointError as e:
        return ("error", str(e))
    except OSError as e:
        return ("error", f"{type(e).__name__}: {e}")
