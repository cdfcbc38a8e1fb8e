"""What every multi-rank weight-transfer test asserts of each rank's record (the scenario
modules record ``error``, ``calls`` (torch.distributed functions called), ``ops`` (c10d
ops run), and on engine ranks ``mismatch`` and ``stale``)."""

from __future__ import annotations

from typing import Any

# One all_reduce validates the plan on every rank before any byte, one closes the call.
CALLS = {"all_reduce", "batch_isend_irecv", "isend", "irecv"}
OPS = {"c10d.allreduce_", "c10d.send", "c10d.recv_"}


def assert_point_to_point(v: dict[str, Any], rank: int, engine: bool) -> None:
    """Rank ``rank``'s transfer went through: no error, the two all_reduces and
    point-to-point only (no all-gather, no broadcast); an engine rank's parameters equal
    the owner's bitwise and are not marked stale."""
    assert v["error"] is None, f"rank {rank}: {v['error']}"
    assert v["calls"].get("all_reduce") == 2, v["calls"]
    assert set(v["calls"]) <= CALLS, v["calls"]
    assert set(v["ops"]) <= OPS, v["ops"]
    if engine:
        assert v["mismatch"] == [], f"rank {rank}: {v['mismatch']}"
        assert not v["stale"]
