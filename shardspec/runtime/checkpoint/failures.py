"""DCP's exceptions as the :class:`CheckpointError` that ``save`` and ``load`` raise: our own
validation error where a rank raised one (DCP wraps every rank's failure), else a
:class:`CheckpointError` caused by DCP's; and the frames of their tracebacks emptied, so
that a failed save or load holds no state dict, model or process group alive.
"""

from __future__ import annotations

from typing import Any

from shardspec.runtime.units import CheckpointError


def _failure(e: BaseException, message: str) -> CheckpointError:
    """The error ``save``/``load`` raise for ``e``, an exception out of ``dcp.save`` or
    ``dcp.load``: our own validation error if a rank raised one (DCP wraps it with every
    rank's failures), else a :class:`CheckpointError` saying ``message``, caused by ``e``.

    ``e``'s finished frames are emptied first (:func:`_clear_frames`): DCP keeps the
    exception it raises in a local of the raising frame (``_DistWrapper.reduce_scatter``:
    ``result = self.scatter_object(...)``, then ``raise result``), so exception, traceback
    and frame form a reference cycle, freed only by the garbage collector. The frames of
    that traceback hold the state dict and the planner (``_save_state_dict``'s locals,
    ``local_step``'s closure, the failing rank's own exception with its
    ``set_up_planner`` frame), hence DTensors and their DeviceMesh with its process
    groups; and each frame holds its caller (``f_back``), up to the training loop's
    frame with the model, the optimizer, a pipeline schedule. One collection is not always
    enough: the last stage's schedule keeps its microbatch losses, whose autograd graphs
    (C++, unseen by the collector) hold the parameters until their tensors are freed by
    a first collection. A refused save at pp > 1 thus left gloo threads running on the
    last stage's ranks after a teardown. With the frames emptied (their lines still
    print) all of it is freed as soon as the error is dropped.
    """
    _clear_frames(e)
    found = _first_checkpoint_error(e)
    if found is not None:  # its frames emptied too; shown without DCP's wrapper
        found.__cause__, found.__suppress_context__ = None, True
        return found
    error = CheckpointError(f"{message}: {_summary(e)}")
    error.__cause__ = e
    return error


def _summary(e: BaseException, shown: int = 4) -> str:
    """``e`` in one line: each failed rank's exception type and the first line of its
    message (DCP's own text holds every rank's traceback: the cause keeps it)."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return _line(e)
    parts = [
        f"rank {r}: {_line(w[0] if isinstance(w, tuple) and w else w)}"
        for r, w in sorted(failures.items(), key=lambda kv: str(kv[0]))
    ]
    more = f"; and {len(parts) - shown} more rank(s)" if len(parts) > shown else ""
    return "; ".join(parts[:shown]) + more


def _line(e: Any, limit: int = 300) -> str:
    """``e``'s type and the first line of its message, without gloo's advice ("This is
    typically caused by ..."), at most ``limit`` characters of it."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    first = first.split(" This is typically caused by")[0]
    if len(first) > limit:
        first = first[:limit] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _clear_frames(e: BaseException) -> None:
    """Empty the finished frames of ``e``'s traceback, and of the exceptions it links to
    (cause, context, DCP's per-rank failures), breaking reference cycles through them. A
    frame still running (the caller's) is left as it is."""
    import traceback

    seen: set[int] = set()
    todo: list[Any] = [e]
    while todo:
        exc = todo.pop()
        if not isinstance(exc, BaseException) or id(exc) in seen:
            continue
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        todo += [exc.__cause__, exc.__context__]
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            for wrapped in failures.values():
                todo.append(wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped)


def _first_checkpoint_error(e: BaseException) -> CheckpointError | None:
    """DCP re-raises rank failures wrapped; find our own validation error inside."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for wrapped in failures.values():
            # DCP keeps each rank's failure as (exception, traceback summary).
            exc = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
            if isinstance(exc, CheckpointError):
                return exc
    if isinstance(e.__cause__, CheckpointError):
        return e.__cause__
    return None
