"""export_hf's chunk exchange: every stored chunk travels once, from the replica that sends
it to the rank that writes its tensor, in one message per (sender, writer) pair, staged in
CPU memory and sent over the export's gloo process group.

**Why CPU, on CUDA too.** A wait of export_hf is bounded the way ``save``'s are
(:mod:`shardspec.runtime.checkpoint.collectives`, "Bounded waits"): a survivor whose
collective failed destroys shardspec's own gloo checkpoint group, so every rank still
waiting on it fails at once instead of waiting out a timeout. Only a group that can be
torn down while a peer is dead gives that bound, and gloo's can: its connections close
and every pending send or receive on them fails. An NCCL communicator gives no such
promise (its operations wait in GPU kernels; tearing one down with a dead peer can hang
until the watchdog's timeout), so the exchange does not run on NCCL. The writer needs
every byte in host memory anyway (safetensors writes from there), so staging costs no
extra crossing of the host link: each chunk is copied to the host once, on its sender
instead of on its writer, and no writer allocates GPU memory for what it receives. The
cost is the wire: between nodes the bytes go over gloo's TCP instead of NCCL's fabric,
once per export.

**Order.** Every rank first posts all its receives (non-blocking), then sends its
messages one at a time, to ``rank + 1``, ``rank + 2``, ... (so that no writer gets every
sender at once). A send waits only for a receive its writer posted before blocking on
anything, so the exchange cannot deadlock. A send or receive that fails (its peer died,
or gave up and destroyed the group) does not stop the others: a rank finishes every
send and every receive, each completed or failed, before it raises, so no operation is
left pending on the group it then destroys and no survivor waits on a message that a
rank which gave up never sent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardspec.runtime.checkpoint.folders import _point


@dataclass
class Messages:
    """This rank's part of the exchange, in host memory: the bytes it sends to each writer
    (its own chunks under its own rank, kept, not sent) and a buffer for what it receives
    from each other sender."""

    rank: int
    send: dict[int, torch.Tensor]
    recv: dict[int, torch.Tensor]

    @property
    def bytes_sent(self) -> int:
        return sum(b.numel() for peer, b in self.send.items() if peer != self.rank)

    @property
    def bytes_received(self) -> int:
        return sum(b.numel() for b in self.recv.values())


def stage_messages(
    outgoing: Mapping[int, Sequence[torch.Tensor]], incoming: Mapping[int, int], rank: int
) -> Messages:
    """``outgoing``: by writer, the flat byte views (``uint8``, on any device) of the
    chunks this rank sends it, in order; ``incoming``: by sender, how many bytes this rank
    receives from it. Copies what is sent to host memory (once) and allocates what is
    received there."""
    send = {peer: _pack(parts) for peer, parts in sorted(outgoing.items())}
    recv = {
        peer: torch.empty(n, dtype=torch.uint8)
        for peer, n in sorted(incoming.items())
        if peer != rank
    }
    return Messages(rank, send, recv)


def _pack(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """One host buffer of ``parts`` in order. A single part already in host memory is used
    as it is (the chunk's own bytes); otherwise each part is copied once, from the device
    where it lives."""
    if len(parts) == 1 and parts[0].device.type == "cpu":
        return parts[0]
    buf = torch.empty(sum(p.numel() for p in parts), dtype=torch.uint8)
    pos = 0
    for p in parts:
        buf[pos : pos + p.numel()].copy_(p)
        pos += p.numel()
    return buf


def exchange(messages: Messages, world: int, group: Any) -> dict[int, torch.Tensor]:
    """Send and receive every message (the module's "Order"); the bytes received, by
    sender, this rank's own included. Raises the backend's error of the first operation
    that failed, once every operation has ended."""
    rank = messages.rank
    received = {rank: messages.send[rank]} if rank in messages.send else {}
    _point("exchanging")
    if world > 1:
        _send_and_receive(messages, world, group)
    _point("exchanged")
    received.update(messages.recv)
    return received


def _send_and_receive(messages: Messages, world: int, group: Any) -> None:
    rank = messages.rank
    failed: list[BaseException] = []
    pending = []
    for peer, buf in sorted(messages.recv.items()):
        try:
            pending.append(dist.irecv(buf, group_src=peer, group=group))
        except RuntimeError as e:  # the connection is already gone
            failed.append(e)
    sent = 0
    for step in range(1, world):
        peer = (rank + step) % world
        if peer in messages.send and _completed(
            functools.partial(_send, messages.send[peer], peer, group), failed
        ):
            sent += 1
            if sent == 1:
                _point("sent-one")
    for work in pending:
        if work is not None:  # None: this rank is not in the group (never: every rank is)
            _completed(work.wait, failed)
    if failed:
        raise failed[0]


def _send(buf: torch.Tensor, peer: int, group: Any) -> None:
    work = dist.isend(buf, group_dst=peer, group=group)
    if work is not None:
        work.wait()


def _completed(op: Callable[[], object], failed: list[BaseException]) -> bool:
    """Run ``op`` (a send, or the wait of a receive): whether it completed; if it failed
    (its peer died, or gave up and destroyed the group), its error is added to
    ``failed``."""
    try:
        op()
    except RuntimeError as e:
        failed.append(e)
        return False
    return True
