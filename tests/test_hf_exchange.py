"""export_hf's chunk exchange (``shardspec/runtime/hf/exchange.py``) in one process: what
is staged in host memory, and the order of sends and receives with a stand-in for
``torch.distributed`` that fails chosen peers. The exchange on real gloo ranks, with
ranks killed inside it, is tests/test_hf_export_crash.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardspec.runtime.checkpoint import folders
from shardspec.runtime.hf import exchange as ex


def _bytes(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def test_messages_are_staged_in_host_memory() -> None:
    one, a, b = _bytes(1, 2), _bytes(3), _bytes(4, 5, 6)
    m = ex.stage_messages({0: [one], 2: [a, b], 1: [_bytes(7)]}, {0: 4, 1: 2, 2: 0}, rank=1)
    assert m.send[0].data_ptr() == one.data_ptr()  # one part in host memory: as it is
    assert m.send[2].tolist() == [3, 4, 5, 6]  # several: one buffer, in order
    assert set(m.recv) == {0, 2} and m.recv[0].numel() == 4 and m.recv[2].numel() == 0
    assert all(t.device.type == "cpu" for t in [*m.send.values(), *m.recv.values()])
    assert (m.bytes_sent, m.bytes_received) == (6, 4)  # its own message is not sent


class _Work:
    def __init__(self, log: list[str], what: str, fails: bool) -> None:
        self.log, self.what, self.fails = log, what, fails

    def wait(self) -> bool:
        self.log.append(f"wait {self.what}")
        if self.fails:
            raise RuntimeError(f"Connection closed by peer ({self.what})")
        return True


class _Dist:
    """``isend``/``irecv`` that log what they are asked, and fail for ``dead`` peers."""

    def __init__(self, dead: set[int]) -> None:
        self.dead = dead
        self.log: list[str] = []

    def isend(self, buf: torch.Tensor, group_dst: int, group: Any) -> _Work:
        dst = group_dst  # ranks in the group, as the exchange passes them
        self.log.append(f"send {dst}")
        return _Work(self.log, f"send {dst}", dst in self.dead)

    def irecv(self, buf: torch.Tensor, group_src: int, group: Any) -> _Work:
        src = group_src
        self.log.append(f"post recv {src}")
        return _Work(self.log, f"recv {src}", src in self.dead)


def _messages(rank: int, world: int) -> ex.Messages:
    every = {peer: [_bytes(peer)] for peer in range(world)}
    return ex.stage_messages(every, {peer: 1 for peer in range(world)}, rank)


def _run(monkeypatch: pytest.MonkeyPatch, dead: set[int]) -> tuple[list[str], list[str], Any]:
    fake, points = _Dist(dead), []
    monkeypatch.setattr(ex, "dist", fake)
    monkeypatch.setattr(folders, "_fault_point", points.append)
    error = None
    try:
        ex.exchange(_messages(1, 4), 4, group="the group")
    except RuntimeError as e:
        error = e
    return fake.log, points, error


def test_receives_first_then_each_send_from_the_next_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    log, points, error = _run(monkeypatch, set())
    assert error is None
    assert log == [
        "post recv 0",
        "post recv 2",
        "post recv 3",
        *("send 2", "wait send 2", "send 3", "wait send 3", "send 0", "wait send 0"),
        *("wait recv 0", "wait recv 2", "wait recv 3"),
    ]
    assert points == ["exchanging", "sent-one", "exchanged"]


def test_a_dead_peer_ends_nothing_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed send does not stop the others, and every receive is waited for, before
    the first error is raised: no operation is left pending on the group the rank then
    destroys, and no peer waits for a message this rank never sent."""
    log, points, error = _run(monkeypatch, {2})
    assert str(error) == "Connection closed by peer (send 2)"
    assert [x for x in log if x.startswith("send")] == ["send 2", "send 3", "send 0"]
    assert [x for x in log if x.startswith("wait recv")] == [
        "wait recv 0",
        "wait recv 2",
        "wait recv 3",
    ]
    assert points == ["exchanging", "sent-one"]  # sent-one: after the send to 3


class _Groups:
    """``torch.distributed`` as ``_export_group`` sees it: a job of 4 ranks, and a group of
    ``size`` ranks (-1: not this rank's) with ``backend``."""

    def __init__(self, size: int, backend: str | None) -> None:
        self.size, self.backend = size, backend

    def is_initialized(self) -> bool:
        return True

    def get_world_size(self, group: Any = None) -> int:
        return 4 if group is None else self.size

    def get_rank(self, group: Any = None) -> int:
        return 0

    def get_backend(self, group: Any) -> str:
        if self.backend is None:
            raise ValueError("Invalid process group specified")
        return self.backend


@pytest.mark.parametrize(
    ("size", "backend", "says"),
    [
        (4, "gloo", None),
        (4, "cpu:gloo,cuda:nccl", None),
        (4, "nccl", "needs a group with a gloo backend, not 'nccl'"),
        (2, "gloo", "a group of the model's 4 ranks, in the mesh's order.*this one has 2 ranks"),
        (-1, "gloo", "this one has not this rank"),
        (4, None, "not a process group of this job"),
    ],
)
def test_a_callers_group_must_carry_the_whole_exchange(
    monkeypatch: pytest.MonkeyPatch, size: int, backend: str | None, says: str | None
) -> None:
    from shardspec.runtime.hf import export

    monkeypatch.setattr(export, "dist", _Groups(size, backend))
    group = object()
    if says is None:
        assert export._export_group(group, 4, 0) is group
    else:
        with pytest.raises(export.HFError, match=says):
            export._export_group(group, 4, 0)


def test_a_callers_group_must_hold_the_ranks_in_mesh_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group of the right size whose rank order is not the mesh's (this rank is mesh rank
    1, and rank 0 of the group) is refused: the export's messages go by group rank."""
    from shardspec.runtime.hf import export

    monkeypatch.setattr(export, "dist", _Groups(4, "gloo"))
    with pytest.raises(export.HFError, match=r"this rank is mesh rank 1, so rank 1 of the group"):
        export._export_group(object(), 4, 1)
