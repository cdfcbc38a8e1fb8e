"""The text ``shardspec transfer`` prints: bytes each rank sends and receives, the
senders' balance, and the wire bytes against the engine's own."""

from __future__ import annotations

from collections.abc import Sequence

from shardspec.transfer.plan import Plan


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover


def balance(sent: Sequence[int]) -> float:
    """max/mean of the bytes sent per trainer rank (1.0: perfectly even; 0 sent: 1.0)."""
    mean = sum(sent) / len(sent) if sent else 0
    return max(sent) / mean if mean else 1.0


def render_text(plan: Plan) -> str:
    """Per rank the bytes sent and received, then the totals."""
    assert plan.trainer is not None and plan.engine is not None
    lines = [
        f"transfer {plan.trainer.path} ({plan.trainer.mesh.world} ranks) -> "
        f"{plan.engine.path} ({plan.engine.mesh.world} ranks): {len(plan.tensors)} tensors, "
        f"{sum(len(t.moves) for t in plan.tensors)} moves",
        "trainer rank  sent",
    ]
    lines += [f"{r:>12}  {_size(n)}" for r, n in enumerate(plan.sent)]
    lines.append("engine rank  received  owned")
    lines += [
        f"{r:>11}  {_size(n):>8}  {_size(o)}"
        for r, (n, o) in enumerate(zip(plan.received, plan.owned, strict=True))
    ]
    ratio = plan.wire_bytes / plan.engine_bytes if plan.engine_bytes else 1.0
    lines.append(f"balance (max/mean bytes sent per trainer rank): {balance(plan.sent):.2f}")
    lines.append(
        f"wire: {_size(plan.wire_bytes)} ({plan.wire_bytes} B) for the engine's "
        f"{_size(plan.engine_bytes)} ({plan.engine_bytes} B): {ratio:.2f}x"
    )
    lines.append(f"fingerprint: {plan.fingerprint}")
    return "\n".join(lines) + "\n"
