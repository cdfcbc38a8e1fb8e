"""File locality: after a restart on the topology a checkpoint was saved with, each rank
reads only the files it wrote itself, and replicas get their copies from the writer over
point-to-point sends (one batched exchange), not by opening another rank's files.

This is what distributed file systems reward (Megatron does the same, see seed 004). It
applies only when the checkpoint's marker records this mesh and the same structure
fingerprint, so the static writer choice at save time is the one computed now; otherwise
:class:`LocalityLoadPlanner` behaves exactly like its parent.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.distributed.tensor import DTensor

from shardspec.runtime.checkpoint.planners import ShardspecLoadPlanner

_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def file_rank(relative_path: str) -> int | None:
    """The rank that wrote a DCP data file (``__{rank}_{n}.distcp``), if it says."""
    m = _FILE.match(relative_path.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def wire_device(backend: str, device: torch.device) -> torch.device:
    """Where a point-to-point message of a tensor on ``device`` travels with the default
    group's ``backend``: the tensor's own device where the backend sends from it (NCCL for
    CUDA, given alone or in a ``"cpu:gloo,cuda:nccl"`` list), else host memory. gloo's send
    and receive take CUDA pointers for host ones (``writev ... Bad address``, then the
    process aborts), seen with several ranks sharing one GPU over gloo."""
    if device.type == "cpu":
        return device
    parts: dict[str, str] = {}
    for part in backend.split(","):
        dev, _, name = part.rpartition(":")
        parts[dev] = name
    chosen = parts.get(device.type, parts.get("", ""))
    return device if chosen and chosen != "gloo" else torch.device("cpu")


class LocalityLoadPlanner(ShardspecLoadPlanner):
    """A staging load planner that reads only this rank's own files when the checkpoint
    was saved on the same mesh with the same structure (``marker`` is the checkpoint's
    ``.shardspec.json``). Call :meth:`exchange` after ``dcp.load`` and before ``commit``."""

    def __init__(
        self,
        spec,
        mesh: Any = None,
        *,
        marker: dict | None = None,
        partial: bool = False,
        keys: Any = None,
    ) -> None:
        super().__init__(spec, mesh, partial=partial, staging=True, keys=keys)
        self.marker = marker or {}
        self.active = False
        self.remote_rest: set[str] = set()
        self.read_rest: dict[str, Any] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        same_mesh = self.marker.get("mesh") == dict(
            zip(self.lmesh.names, self.lmesh.sizes, strict=True)
        )
        # The exchange shares entries that are no storage unit whole, by key: a DTensor
        # among them (a state-dict hook's key saved with strict=False) holds a different
        # chunk on each rank, so such a state dict reads as any other.
        sharded_rest = any(isinstance(v, DTensor) for v in self.state_dict.values())
        self.active = bool(
            same_mesh
            and self.marker.get("fingerprint") == self.canon.fingerprint
            and not self._legacy
            and not sharded_rest
            and metadata is not None
            and metadata.storage_data
        )

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        if not self.active:
            return plan
        assert self.metadata is not None
        storage = self.metadata.storage_data
        mine = []
        self.own_items: list = []  # chunk reads from this rank's own files
        self.recv_items: list = []  # (writer, read) that other ranks' files hold
        for item in plan.items:
            owner = file_rank(storage[item.storage_index].relative_path)
            key = item.dest_index.fqn
            if owner in (None, self.rank):
                mine.append(item)
                if key in self.local:
                    self.own_items.append(item)
            elif key in self.local:
                self.recv_items.append((owner, item))
            else:
                self.remote_rest.add(key)
        return LoadPlan(mine)

    def _region(self, item) -> torch.Tensor:
        """The part of a unit's staging buffer that a read item fills."""
        out = self._buffer(item.dest_index.fqn)
        for d, (o, n) in enumerate(zip(item.dest_offsets, item.lengths, strict=True)):
            out = out.narrow(d, o, n)
        return out

    @staticmethod
    def _piece_key(item) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        return (item.dest_index.fqn, tuple(item.dest_offsets), tuple(item.lengths))

    def _read(self, item) -> torch.Tensor:
        """What this rank read for a read item of its own files, contiguous and on the
        live tensor's device (the process group's: chunks kept as read are on the CPU)."""
        if self.capture:
            _, live = self.local[item.dest_index.fqn]
            return self._pieces[self._piece_key(item)].to(live.device).contiguous()
        return self._region(item).contiguous()

    # Record what this rank read of the small, replicated entries, for the exchange.
    def load_bytes(self, read_item, value) -> None:
        super().load_bytes(read_item, value)
        if self.active:
            value.seek(0)
            self.read_rest[read_item.dest_index.fqn] = (
                "bytes",
                torch.load(value, weights_only=False),
            )

    def commit_tensor(self, read_item, tensor) -> None:
        super().commit_tensor(read_item, tensor)
        key = read_item.dest_index.fqn
        if self.active and key not in self.local and read_item.type == LoadItemType.TENSOR:
            self.read_rest[key] = ("tensor", self.lookup_tensor(read_item.dest_index))

    def exchange(self) -> int:
        """Send every chunk this rank wrote to the replicas that need it, receive what this
        rank did not read, and share the small replicated entries. Returns bytes received."""
        if not dist.is_initialized():
            return 0
        # Decided the same way on every rank (same marker, same structure), but make sure.
        # One gather: every rank's decision, and the small replicated entries it read.
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.active, self.read_rest if self.active else {}))
        flags = [active for active, _ in gathered]
        if not all(flags):
            if any(flags):
                raise RuntimeError("ranks disagree on file locality; load without it")
            return 0

        def order(item) -> tuple:
            return (
                item.dest_index.fqn,
                tuple(item.storage_index.offset or ()),
                tuple(item.storage_offsets),
                tuple(item.lengths),
            )

        # Same topology, so replicas hold the same chunk and read the same pieces: each
        # rank sends what it read from its own files to the other replicas, and receives
        # the rest from the rank whose file holds it, pairs matched by this order.
        ops, pending, received = [], [], 0
        backend = str(dist.get_backend())
        for item in sorted(self.own_items, key=order):
            unit, live = self.local[item.dest_index.fqn]
            peers = [p for p in unit.replicas if p != self.rank]
            if peers:
                data = self._read(item).to(wire_device(backend, live.device))
                ops += [dist.P2POp(dist.isend, data, peer) for peer in peers]
        for owner, item in sorted(self.recv_items, key=lambda x: order(x[1])):
            _, live = self.local[item.dest_index.fqn]
            wire = wire_device(backend, live.device)
            tmp = torch.empty(tuple(item.lengths), dtype=live.dtype, device=wire)
            ops.append(dist.P2POp(dist.irecv, tmp, owner))
            pending.append((item, tmp))
            received += tmp.numel() * tmp.element_size()
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        for item, tmp in pending:
            if self.capture:  # the received chunk is the staged copy
                self._pieces[self._piece_key(item)] = tmp
            else:
                self._region(item).copy_(tmp)  # to the live tensor's device, if it was sent
                # through host memory
        merged: dict[str, Any] = {}
        for _, part in gathered:
            merged.update(part)
        for key in sorted(self.remote_rest):
            kind, value = merged[key]
            if kind == "tensor":
                self.lookup_tensor(MetadataIndex(key)).copy_(value)
            else:
                self._set_object(key, value)
        return received
