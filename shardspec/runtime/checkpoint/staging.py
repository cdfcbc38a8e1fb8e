"""Staging memory: where a save's or a load's bytes wait while the live tensors may change.

* An asynchronous save copies the chunks this rank writes to CPU memory (pinned from CUDA)
  before it returns (:func:`_cpu_copy`, :func:`_stage_value`); the buffers of the last
  save that completed are kept for the next one (a fresh buffer costs its page faults or a
  slow ``cudaHostAlloc``) until :func:`free_staging_memory`.
* A staged load with DCP's own ``FileSystemReader`` reads into :class:`_Sink` tensors,
  which keep the chunk as read instead of copying it (:func:`reader_fills_sinks` says
  whether a reader is one that does just that).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from shardspec.runtime.units import CheckpointError


class _Sink(torch.Tensor):
    """A staging tensor without storage. ``FileSystemReader`` copies each chunk it read
    into the tensor ``resolve_tensor`` returns, then calls ``commit_tensor`` with it; a
    sink keeps a reference to the chunk instead of copying it, so the chunk as read is the
    staged copy (one copy of every byte less, and no separate buffer to fault in). Any
    other use raises: only readers known to do just that get sinks."""

    source: torch.Tensor | None

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype) -> _Sink:
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=torch.device("cpu"))
        t.source = None
        return t

    @classmethod  # torch's stub types Tensor's as a staticmethod; subclasses write it so
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        if func is torch.ops.aten.detach.default:
            return args[0]
        if func is torch.ops.aten.copy_.default and isinstance(args[1], torch.Tensor):
            args[0].source = args[1]
            return args[0]
        raise CheckpointError(f"staging sink: unexpected {func} from the storage reader")


def reader_fills_sinks(reader: Any) -> bool:
    """Whether ``reader`` reads tensors the way :class:`_Sink` relies on: DCP's own
    ``FileSystemReader.read_data`` (``resolve_tensor(...).detach().copy_(chunk)``, then
    ``commit_tensor``), not overridden."""
    own = getattr(dcp.FileSystemReader, "read_data", None)
    return own is not None and getattr(type(reader), "read_data", None) is own


# Staging buffers of the last asynchronous save that completed, reused by the next one: a
# fresh buffer costs its page faults (on CPU several times the copy itself) or, pinned, a
# slow cudaHostAlloc. Keyed by (shape, dtype, pinned). See free_staging_memory().
_POOL: dict[tuple, list[torch.Tensor]] = {}
_POOL_LOCK = threading.Lock()


def _pool_key(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.is_pinned())


def _take(shape: torch.Size, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    with _POOL_LOCK:
        free = _POOL.get((tuple(shape), dtype, pinned))
        if free:
            return free.pop()
    return torch.empty(shape, dtype=dtype, pin_memory=pinned)


def _give(buffers: list[torch.Tensor]) -> None:
    """Keep ``buffers`` (a finished save's) for the next save, in place of any kept before:
    at most one save's staging memory is held."""
    with _POOL_LOCK:
        _POOL.clear()
        for buf in buffers:
            _POOL.setdefault(_pool_key(buf), []).append(buf)


def free_staging_memory() -> None:
    """Release the CPU (pinned) staging buffers that asynchronous saves keep for the next
    one (the size of one save's part on this rank)."""
    with _POOL_LOCK:
        _POOL.clear()


def _cpu_copy(data: torch.Tensor, live: torch.Tensor, pooled: list | None = None) -> torch.Tensor:
    """A CPU copy of ``data`` that later changes to ``live`` cannot reach: pinned memory,
    filled asynchronously, for a CUDA tensor (the caller synchronizes once); a copy for a
    CPU view of ``live``; ``data`` itself where it is already a fresh tensor (a unit cut in
    several runs is concatenated into new memory). With ``pooled``, the copy goes to a
    reused staging buffer, appended there."""
    fresh = data.device.type == "cpu" and (
        data.untyped_storage().data_ptr() != live.untyped_storage().data_ptr()
    )
    if fresh:
        return data
    pinned = data.device.type != "cpu" and torch.cuda.is_available()
    if pooled is None:
        buf = torch.empty(data.shape, dtype=data.dtype, pin_memory=pinned)
    else:
        buf = _take(data.shape, data.dtype, pinned)
        pooled.append(buf)
    buf.copy_(data, non_blocking=pinned)
    return buf


def _stage_value(value: Any) -> Any:
    """A copy of a state-dict entry that is not a storage unit (CPU for tensors)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = value.to_local()
        return DTensor.from_local(
            _cpu_copy(local, local),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, torch.Tensor):
        return _cpu_copy(value, value)
    import copy

    return copy.deepcopy(value)
