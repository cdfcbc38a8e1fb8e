"""Checkpoint speed: shardspec's generated DCP planners against DCP's default planners.

    python -m bench.bench_checkpoint                    # both parts (a few minutes)
    python -m bench.bench_checkpoint --part io --rounds 7
    python -m bench.bench_checkpoint --part plan --worlds 8,64,512,4096
    python -m bench.bench_checkpoint --part io --profile save:common:gen,load:common:gen:warm

Part ``io``: 4 gloo CPU ranks, a Llama (``examples/models/llama.py``) on the llama spec's
layout (mesh dp_shard 2 x tp 2) with Adam state, saved with ``dcp.save`` and loaded with
``dcp.load`` through ``FileSystemWriter``/``FileSystemReader`` in a temporary folder on
local disk. Every round times, in alternating order, the same state dict through

* ``default``: DCP's ``DefaultSavePlanner`` / ``DefaultLoadPlanner``;
* ``gen``: the generated ``SavePlanner`` / ``LoadPlanner`` (``dcp.save``/``dcp.load`` with
  them: the planners alone);
* ``helper``: the generated ``save()`` / ``load()`` (atomic save with a marker; load with
  validation, staging buffers, file locality and a commit after every rank's reads).

DCP's default planner refuses the fused ``w13`` (``_StridedShard`` over tp on dim 0, with
FSDP on dim 1: its chunks "overlap" in DCP's view), so the comparison runs on the
``common`` state dict (every entry except ``feed_forward.w13``, model and optimizer), and
the generated planners alone also run on the ``full`` state dict.

Throughput is the state dict's logical size (the bytes of every tensor's global shape,
counted once however it is replicated) over the wall time of the call on the slowest rank,
between two barriers. Writes go through ``FileSystemWriter``'s default ``fsync``. Loads run
twice: ``warm`` (right after the save, so reads come from the page cache) and ``cold``
(after ``posix_fadvise(DONTNEED)`` on every file of the checkpoint, which drops its clean
pages from the page cache; the hypervisor may still cache the virtual disk).

Part ``plan``: planning cost against simulated world size, in this process, without a
process group. The state dict is the model of a Llama 3 8B (32 layers) on the llama spec's
layout with tp 2 and dp_shard = world / 2. Local save plans of every rank are built as each
planner would build them (the default's DTensor chunks by shardspec's mirror of torch's
``compute_local_shape_and_global_offset``, checked against torch's on sampled ranks; the
generated planner's from its canonical pieces and writer map, checked item for item against
the real planner on sampled ranks), then
``create_global_plan`` (the coordinator's work) is timed on the N plans (the generated
planner checks them in linear time; DCP's default check is quadratic for FSDP x TP grids).
Also timed: one rank's local planning (save and load), which for the generated planner
includes the static writer assignment over every distinct replicated chunk, once for a
structure not planned before and once for the same structure again (its cached plan).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import datetime
import gc
import io
import json
import math
import os
import pickle
import platform
import pstats
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# The I/O benchmark's model: 128M parameters (0.51 GB fp32), 1.54 GB with Adam's two moments.
IO_MODEL: dict[str, int] = dict(
    vocab_size=16384, dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, head_dim=64, ffn_dim=2816
)
# Llama 3 8B's shapes, for the planning simulation (only shapes matter there).
SIM_MODEL: dict[str, int] = dict(
    vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336
)
IO_WORLD = 4
IO_SIZES = {"tp": 2}  # dp_shard takes the rest: 2
SIM_WORLDS = (8, 64, 512, 4096)
SIM_TP = 2
TARGET = 0.95  # generated / default throughput, save and load

# Operations of the I/O part: (state dict, planner).
SAVES = (
    ("common", "default"),
    ("common", "gen"),
    ("common", "helper"),
    ("full", "gen"),
    ("full", "helper"),
)
LOADS = SAVES
EXCLUDED = ".feed_forward.w13."  # what DCP's default planner refuses


# ----------------------------------------------------------------------------- spec


def bench_spec(model_cfg: dict[str, int]):
    """``generated.llama``'s spec for a Llama of another size: the same axes and rules, a
    manifest table (``PARAMS``) of this model, and the fused q/k/v rule's group layout
    matching its heads (the spec file hard-codes the tiny model's 2 groups of 32/16/16).
    For the tiny default model this is ``generated.llama.SPEC`` itself, table for table.
    """
    import torch

    import generated.llama as L
    from examples.models.llama import Llama, LlamaConfig
    from shardspec.runtime import CompiledSpec, Param

    cfg = LlamaConfig(**model_cfg)
    rules = list(L.RULES)
    for i, r in enumerate(rules):
        if r.pattern == "layers.*.attention.wqkv.weight":
            comps = (
                ("q", cfg.q_per_group * cfg.head_dim),
                ("k", cfg.head_dim),
                ("v", cfg.head_dim),
            )
            rules[i] = dataclasses.replace(r, fuse=(("qkv", comps, cfg.n_kv_heads),))
    kwargs = dict(
        name=L.SPEC.name,
        axes=L.AXES,
        sizes=L.DEFAULT_SIZES,
        world=L.DEFAULT_WORLD,
        rules=tuple(rules),
        ignore=L.IGNORE,
        name_indexed_counts=L.NAME_INDEXED_COUNTS,
    )
    matcher = CompiledSpec(params=None, **kwargs)
    with torch.device("meta"):
        model = Llama(cfg)
    params = {
        fqn: Param(matcher.match(fqn)[0], tuple(p.shape), str(p.dtype).removeprefix("torch."))
        for fqn, p in model.named_parameters()
    }
    return CompiledSpec(params=dict(sorted(params.items())), **kwargs)


# ----------------------------------------------------------------------------- I/O part


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _tensors(state) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def logical_bytes(state) -> int:
    """Bytes of every tensor at its global shape (a replicated tensor counts once)."""
    return sum(v.numel() * v.element_size() for v in _tensors(state).values())


def _common(state: dict) -> dict:
    """``state`` without the entries DCP's default planner refuses (same tensors)."""
    model = {k: v for k, v in state["model"].items() if EXCLUDED not in k}
    optim = state["optim"]
    groups = [
        {**g, "params": [p for p in g["params"] if EXCLUDED not in p]}
        for g in optim["param_groups"]
    ]
    opt_state = {k: v for k, v in optim["state"].items() if EXCLUDED not in k}
    return {"model": model, "optim": {"state": opt_state, "param_groups": groups}}


def build_state(spec, mesh, model_cfg: dict[str, int], adam: bool) -> dict:
    """Model (distributed on the spec's layout) and Adam state, as DCP state dicts, with
    the same values on every replica (so a load can be checked against what was saved)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from examples.models.llama import Llama, LlamaConfig
    from shardspec.runtime import dtensor as rt

    with torch.device("meta"):
        model = Llama(LlamaConfig(**model_cfg))
    rt.distribute(spec, model, mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Seeded by the chunk's global offset: replicas draw the same values.
            _, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            gen = torch.Generator().manual_seed(zlib.crc32(f"{name}:{tuple(offsets)}".encode()))
            p.to_local().normal_(0.0, 0.02, generator=gen)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3) if adam else None
    if opt is not None:
        for p in model.parameters():
            p.grad = p.detach() * 0.5
        opt.step()
        opt.zero_grad(set_to_none=True)
        msd, osd = get_state_dict(model, opt)
    else:
        msd, osd = model.state_dict(), {"state": {}, "param_groups": []}
    return {"model": msd, "optim": osd}


_READ: dict[str, int] = {}


def _count_reads() -> None:
    """Record each ``FileSystemReader.read_data``'s bytes (what the reader reads from files:
    the whole stored chunk of every read item) and item count; every planner alike."""
    from torch.distributed.checkpoint import FileSystemReader

    orig = FileSystemReader.read_data
    if getattr(orig, "_counting", False):
        return

    def read_data(self, plan, planner):
        _READ["bytes"] = sum(self.storage_data[i.storage_index].length for i in plan.items)
        _READ["items"] = len(plan.items)
        return orig(self, plan, planner)

    read_data._counting = True  # type: ignore[attr-defined]
    FileSystemReader.read_data = read_data  # type: ignore[method-assign]


def _evict(path: str) -> None:
    """Drop a checkpoint's (clean, fsynced) pages from the page cache."""
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _file_bytes(path: str, world: int) -> tuple[list[int], int]:
    """Bytes of each rank's data files, and of the metadata file."""
    per = [0] * world
    for name in os.listdir(path):
        if name.endswith(".distcp"):
            per[int(name[2:].split("_")[0])] += os.path.getsize(os.path.join(path, name))
    meta = os.path.join(path, ".metadata")
    return per, os.path.getsize(meta) if os.path.exists(meta) else 0


def _plan_bytes(plan) -> int:
    """Tensor bytes a rank's final save plan writes."""
    from torch.distributed.checkpoint.planner import WriteItemType

    total = 0
    for item in plan.items:
        if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
            itemsize = item.tensor_data.properties.dtype.itemsize
            total += math.prod(item.tensor_data.chunk.sizes) * itemsize
    return total


def _io_rank(rank: int, world: int, opts: dict) -> dict:
    """One rank of the I/O part (run by ``shardspec.testing.run_ranks``)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    from shardspec.runtime import checkpoint as ckpt
    from shardspec.runtime import dtensor as rt

    torch.set_num_threads(1)  # 4 ranks share the cores; no intra-op threads
    _count_reads()
    t_setup = time.perf_counter()
    spec = bench_spec(opts["model"])
    mesh = rt.build_mesh(spec, **opts["sizes"])
    states = {"full": build_state(spec, mesh, opts["model"], opts["adam"])}
    states["common"] = _common(states["full"])
    sizes = {k: logical_bytes(s) for k, s in states.items()}
    reference = {
        k: v.clone() for k, v in ((k, _local(v)) for k, v in _tensors(states["full"]).items())
    }
    workdir = opts["workdir"]

    def path(which: str, kind: str) -> str:
        return os.path.join(workdir, f"{which}-{kind}")

    planners: dict[tuple[str, str], Any] = {}

    def save(which: str, kind: str) -> None:
        state, p = states[which], path(which, kind)
        if kind == "default":
            planner = DefaultSavePlanner()
            dcp.save(state, storage_writer=dcp.FileSystemWriter(p), planner=planner)
        elif kind == "gen":
            planner = ckpt.ShardspecSavePlanner(spec, mesh)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(p), planner=planner)
        else:
            planner = ckpt.save(
                spec, state, p, mesh=mesh, planner=ckpt.ShardspecSavePlanner(spec, mesh)
            )
        planners[(which, kind)] = planner

    def load(which: str, kind: str) -> None:
        state, p = states[which], path(which, kind)
        if kind == "default":
            planner = DefaultLoadPlanner()
            dcp.load(state, storage_reader=dcp.FileSystemReader(p), planner=planner)
        elif kind == "gen":
            planner = ckpt.ShardspecLoadPlanner(spec, mesh)
            dcp.load(state, storage_reader=dcp.FileSystemReader(p), planner=planner)
        else:
            planner = ckpt.load(spec, state, p, mesh=mesh)
        planners[("load", which, kind)] = planner

    def timed(fn: Callable[[], None]) -> tuple[float, float]:
        """Wall time between barriers, and this process's CPU time (all threads) in it."""
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        dist.barrier()
        return time.perf_counter() - t0, time.process_time() - c0

    def prepare_save(which: str, kind: str) -> None:
        if rank == 0:
            for suffix in ("", ".partial", ".old"):
                shutil.rmtree(path(which, kind) + suffix, ignore_errors=True)
        dist.barrier()

    def prepare_cold(which: str, kind: str) -> None:
        if rank == 0:
            _evict(path(which, kind))
        dist.barrier()

    profile_ops = set(filter(None, (opts.get("profile") or "").split(",")))
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    info: dict[str, Any] = {"sizes": sizes, "checks": {}, "written": {}, "read": {}}
    info["setup_s"] = time.perf_counter() - t_setup
    for rnd in range(opts["rounds"] + 1):  # round 0: warm-up, checks, byte counts; untimed
        order = list(SAVES) if rnd % 2 == 0 else list(reversed(SAVES))
        for which, kind in order:
            prepare_save(which, kind)
            tag = f"save:{which}:{kind}"
            prof = cProfile.Profile() if tag in profile_ops and rank == 0 and rnd == 1 else None
            with prof or contextlib.nullcontext():
                t, c = timed(lambda: save(which, kind))  # noqa: B023
            if prof is not None:
                info.setdefault("profile", {})[tag] = _profile_text(prof)
            if rnd:
                times.setdefault(tag, []).append(t)
                cpu.setdefault(tag, []).append(c)
            else:
                planner = planners[(which, kind)]
                mine = _plan_bytes(planner.plan)
                extra = planner.bytes_written() if hasattr(planner, "bytes_written") else None
                info["written"][tag] = {"plan": mine, "bytes_written()": extra}
                if rank == 0:
                    info["written"][tag]["files"] = _file_bytes(path(which, kind), world)
        for temp in ("warm", "cold"):
            for which, kind in order:
                if temp == "cold":
                    prepare_cold(which, kind)
                tag = f"load:{which}:{kind}:{temp}"
                if rnd == 0 and temp == "warm":
                    # Check: zero the live tensors, load, compare with what was saved.
                    with torch.no_grad():
                        for v in _tensors(states[which]).values():
                            _local(v).zero_()
                prof = cProfile.Profile() if tag in profile_ops and rank == 0 and rnd == 1 else None
                _READ.clear()
                with prof or contextlib.nullcontext():
                    t, c = timed(lambda: load(which, kind))  # noqa: B023
                if prof is not None:
                    info.setdefault("profile", {})[tag] = _profile_text(prof)
                if rnd:
                    times.setdefault(tag, []).append(t)
                    cpu.setdefault(tag, []).append(c)
                elif temp == "warm":
                    planner = planners[("load", which, kind)]
                    info["read"][f"load:{which}:{kind}"] = dict(_READ, p2p=_p2p_bytes(planner))
                    bad = [
                        k
                        for k, v in _tensors(states[which]).items()
                        if not torch.equal(_local(v), reference[k])
                    ]
                    info["checks"][f"load:{which}:{kind}"] = bad
    info["times"] = times
    info["cpu"] = cpu
    return info


def _p2p_bytes(planner) -> int | None:
    """Bytes a file-locality load (the generated ``load()``) receives from other ranks
    instead of reading them from files; None where the planner does not say."""
    recv = getattr(planner, "recv_items", None)
    if recv is None:
        return 0 if not getattr(planner, "active", False) else None
    return sum(
        math.prod(item.lengths) * planner.local[item.dest_index.fqn][0].itemsize for _, item in recv
    )


def _profile_text(prof: cProfile.Profile, top: int = 20) -> str:
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def run_io(
    model: dict[str, int] | None = None,
    *,
    rounds: int = 5,
    adam: bool = True,
    world: int = IO_WORLD,
    sizes: dict[str, int] | None = None,
    workdir: str | None = None,
    profile: str | None = None,
) -> dict:
    """Run the I/O part on ``world`` gloo ranks; returns per-op times (max over ranks per
    round), byte counts and checks."""
    from shardspec.testing import run_ranks

    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="shardspec-bench-ckpt-")
    opts = dict(
        model=model if model is not None else IO_MODEL,
        rounds=rounds,
        adam=adam,
        sizes=sizes if sizes is not None else IO_SIZES,
        workdir=workdir,
        profile=profile,
    )
    try:
        per_rank = run_ranks(_io_rank, world, opts, timeout=900.0)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    first = per_rank[0]
    times = {
        tag: [max(r["times"][tag][i] for r in per_rank) for i in range(rounds)]
        for tag in first["times"]
    }
    cpu = {  # CPU seconds per call, summed over ranks
        tag: [sum(r["cpu"][tag][i] for r in per_rank) for i in range(rounds)]
        for tag in first["cpu"]
    }
    written = {}
    for tag, w in first["written"].items():
        written[tag] = {
            "plan": [r["written"][tag]["plan"] for r in per_rank],
            "bytes_written()": [r["written"][tag]["bytes_written()"] for r in per_rank],
            "files": w["files"][0],
            "metadata": w["files"][1],
        }
    read = {tag: [r["read"][tag] for r in per_rank] for tag in first["read"]}
    checks = {
        tag: sorted({k for r in per_rank for k in r["checks"][tag]}) for tag in first["checks"]
    }
    return dict(
        times=times,
        cpu=cpu,
        sizes=first["sizes"],
        written=written,
        read=read,
        checks=checks,
        profile=first.get("profile"),
        setup_s=max(r["setup_s"] for r in per_rank),
        workdir=workdir,
        world=world,
        rounds=rounds,
        model=opts["model"],
        adam=adam,
    )


# ----------------------------------------------------------------------------- plan part


class FakeMesh:
    """What the planners read from a DeviceMesh: axis names, sizes, this rank's coordinate."""

    def __init__(self, names: tuple[str, ...], sizes: tuple[int, ...], coord: tuple[int, ...]):
        self.mesh_dim_names = names
        self.shape = sizes
        self._coord = coord

    def get_coordinate(self) -> list[int]:
        return list(self._coord)


def _clear_caches() -> None:
    """Empty shardspec's and DCP's process-wide caches (layouts, pieces, cached plans)."""
    from torch.distributed.checkpoint.planner import SavePlanner

    from shardspec.core import layout
    from shardspec.runtime import canonical, checkpoint

    for f in (
        canonical.rank_pieces,
        canonical.replica_groups,
        canonical.chunk_table,
        canonical.unreplicated,
        canonical.rank_elements,
        layout.representable,
    ):
        f.cache_clear()
    checkpoint.clear_plan_cache()
    for name in dir(SavePlanner):
        if name.startswith("_cached_") and isinstance(getattr(SavePlanner, name), dict):
            getattr(SavePlanner, name).clear()


class _Sim:
    """One simulated world: the spec, a mesh of ``world`` ranks, a meta state dict."""

    def __init__(self, spec, world: int, tp: int, exclude: str | None) -> None:
        import torch

        from shardspec.core.layout import Mesh

        self.spec, self.world = spec, world
        sizes = spec.sizes(world=world, tp=tp)
        self.lm = Mesh(tuple(sizes), tuple(sizes.values()))
        self.state = {
            fqn: torch.empty(p.shape, dtype=getattr(torch, p.dtype), device="meta")
            for fqn, p in spec.params.items()
            if exclude is None or exclude not in fqn
        }
        self._info: dict[str, tuple] = {}

    def mesh(self, rank: int) -> FakeMesh:
        return FakeMesh(self.lm.names, self.lm.sizes, self.lm.coord_of(rank))

    # -- DCP's default planner: one DTensor chunk per parameter, on every rank

    def _dtensor_info(self, fqn: str):
        """``(shape, DTensor mesh, placements as tuples, as torch objects, mesh positions)``."""
        hit = self._info.get(fqn)
        if hit is None:
            from shardspec.core.layout import dtensor_mesh, dtensor_placements
            from shardspec.runtime.dtensor import to_torch

            layout = self.spec.layout(fqn, self.lm)
            sub = dtensor_mesh(layout, self.lm)
            raw = dtensor_placements(layout, self.lm)
            pos = tuple(self.lm.names.index(n) for n in sub.names)
            hit = (tuple(self.state[fqn].shape), sub, raw, tuple(to_torch(p) for p in raw), pos)
            self._info[fqn] = hit
        return hit

    def default_chunks(self, rank: int, fast: bool = False) -> list[tuple[str, Any, Any]]:
        """``(fqn, sizes, offsets)`` of every parameter's DTensor chunk on ``rank``: by the
        function DCP's default planner calls (torch's ``_compute_local_shape_and_global_offset``)
        or, ``fast``, by its pure-Python mirror
        ``shardspec.core.layout.torch_local_shape_and_offset``
        (memoized per shape and placements; the caller checks both agree on sampled ranks)."""
        import torch
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

        from shardspec.core.layout import torch_local_shape_and_offset

        coord = self.lm.coord_of(rank)
        memo: dict = {}
        out = []
        for fqn in self.state:
            shape, sub, raw, placements, pos = self._dtensor_info(fqn)
            sub_coord = [coord[p] for p in pos]
            if fast:
                key = (shape, raw, pos)
                hit = memo.get(key)
                if hit is None:
                    sizes, offsets = torch_local_shape_and_offset(shape, sub, raw, sub_coord)
                    hit = memo[key] = (torch.Size(sizes), torch.Size(offsets))
            else:
                sizes, offsets = _compute_local_shape_and_global_offset(
                    shape, sub.sizes, sub_coord, placements
                )
                hit = (torch.Size(sizes), torch.Size(offsets))
            out.append((fqn, *hit))
        return out

    def default_local_plan(self, rank: int, fast: bool = False):
        """The SavePlan ``DefaultSavePlanner.create_local_plan`` makes for a state dict of
        these DTensors (``_create_write_items_for_dtensor`` for each)."""
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import (
            SavePlan,
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        items = []
        for fqn, sizes, offsets in self.default_chunks(rank, fast):
            t = self.state[fqn]
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                        properties=TensorProperties.create_from_tensor(t),
                        size=t.size(),
                    ),
                )
            )
        return SavePlan(items, planner_data={k: (k,) for k in self.state})

    def default_local_load(self, rank: int, metadata) -> list:
        """``DefaultLoadPlanner.create_local_plan``'s reads for these DTensors."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        md = metadata.state_dict_metadata
        items = []
        for fqn, sizes, offsets in self.default_chunks(rank):
            chunk = ChunkStorageMetadata(offsets=offsets, sizes=sizes)
            items.extend(create_read_items_for_chunk_list(fqn, md[fqn], [chunk]))
        return items

    # -- the generated planner

    def gen_planner(self, rank: int):
        from shardspec.runtime.checkpoint import ShardspecSavePlanner

        p = ShardspecSavePlanner(self.spec, self.mesh(rank), enable_plan_caching=False)
        p.set_up_planner(self.state, None, rank == 0)
        return p

    def gen_local_plan(self, rank: int):
        """What the generated ``SavePlanner`` sends the coordinator from ``rank`` (the real
        planner, ``set_up_planner`` + ``create_local_plan``)."""
        return self.gen_planner(rank).create_local_plan()

    def gen_local_plans(self) -> list:
        """Every rank's generated local plan, built from one rank's canonical plan (the
        writer map is the same on every rank) and the cached per-rank pieces; equal, item
        for item, to :meth:`gen_local_plan` (checked on sampled ranks by the caller)."""
        import torch
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import (
            SavePlan,
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        from shardspec.runtime.canonical import rank_pieces

        p0 = self.gen_planner(0)
        writer, planner_data = p0.canon.writer, p0.mappings
        items: list[list] = [[] for _ in range(self.world)]
        for key in sorted(self.state):
            t = self.state[key]
            props = TensorProperties(dtype=t.dtype)
            layout = self.spec.layout(key, self.lm)
            if any(d.name_indexed for d in layout.dims):
                raise NotImplementedError("name-indexed dimensions: not simulated")
            for r, row in enumerate(rank_pieces(layout, self.lm)):
                for piece in row:
                    if any(s == 0 for s in piece.sizes):
                        continue
                    name = key if piece.component is None else f"{key}.{piece.component}"
                    if writer.get((name, piece.offsets), r) != r:  # one holder: it writes
                        continue
                    offsets = torch.Size(piece.offsets)
                    items[r].append(
                        WriteItem(
                            index=MetadataIndex(name, offsets),
                            type=WriteItemType.SHARD,
                            tensor_data=TensorWriteData(
                                chunk=ChunkStorageMetadata(
                                    offsets=offsets, sizes=torch.Size(piece.sizes)
                                ),
                                properties=props,
                                size=torch.Size(piece.shape),
                            ),
                        )
                    )
        return [SavePlan(i, planner_data=planner_data) for i in items]


def _best(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    best, out = math.inf, None
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _sample_ranks(world: int) -> list[int]:
    return sorted({0, world // 2 + 1, world - 1} & set(range(world)))


def run_plan(
    model: dict[str, int] | None = None,
    worlds: Iterable[int] = SIM_WORLDS,
    *,
    tp: int = SIM_TP,
    repeat: int = 3,
    full_max_world: int = 4096,
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """Planning time per simulated world size (see the module docstring). Above 512 ranks
    every time is one run (a global plan takes tens of seconds there); above
    ``full_max_world`` the full state dict's global plan is skipped."""
    spec = bench_spec(model if model is not None else SIM_MODEL)
    rows = []
    for world in worlds:
        rep = repeat if world <= 512 else 1
        rows.append(_plan_world(spec, world, tp, rep, world <= full_max_world))
        gc.collect()
        _log(log, rows[-1])
    return rows


def _plan_world(spec, world: int, tp: int, rep: int, with_full: bool) -> dict:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from shardspec.runtime.checkpoint import ShardspecLoadPlanner, ShardspecSavePlanner

    row: dict[str, Any] = {"world": world}
    _clear_caches()
    common = _Sim(spec, world, tp, EXCLUDED)
    full = _Sim(spec, world, tp, None)
    row["mesh"] = dict(zip(common.lm.names, common.lm.sizes, strict=True))
    row["tensors"] = {"common": len(common.state), "full": len(full.state)}
    other = 1 % world  # a rank other than the coordinator

    # One rank's local planning (cold: shardspec's layout caches empty; warm: filled, but
    # a structure not planned before; cached: the same structure again, as on every save
    # after the first).
    from shardspec.runtime.checkpoint import clear_plan_cache

    _clear_caches()
    row["local_save_gen_cold"], _ = _best(lambda: common.gen_local_plan(0), 1)

    def uncached(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            clear_plan_cache()
            return fn()

        return run

    row["local_save_gen"], plan0 = _best(uncached(lambda: common.gen_local_plan(other)), rep)
    row["local_save_gen_cached"], _ = _best(lambda: common.gen_local_plan(other), rep)
    row["local_save_default"], dplan0 = _best(lambda: common.default_local_plan(other), rep)
    row["plan_pickle_bytes"] = {
        "default": len(pickle.dumps(dplan0)),
        "gen": len(pickle.dumps(plan0)),
    }

    # Every rank's local plan, then the coordinator's create_global_plan.
    t0 = time.perf_counter()
    dplans = [common.default_local_plan(r, fast=True) for r in range(world)]
    gplans = common.gen_local_plans()
    for r in _sample_ranks(world):
        if common.default_chunks(r) != common.default_chunks(r, fast=True):
            raise AssertionError(f"rank {r}: shardspec's mirror of DTensor chunks differs")
        _check_same(common.gen_local_plan(r), gplans[r], r)
    row["build_s"] = time.perf_counter() - t0
    row["items"] = {
        "default": sum(len(p.items) for p in dplans),
        "gen": sum(len(p.items) for p in gplans),
    }

    def global_plan(factory, plans):
        def run():
            _clear_caches_dcp()
            return factory().create_global_plan(plans)

        return run

    row["global_default"], (dglobal, dmeta) = _best(global_plan(DefaultSavePlanner, dplans), rep)
    fake = common.mesh(0)
    row["global_gen"], (gglobal, gmeta) = _best(
        global_plan(lambda: ShardspecSavePlanner(common.spec, fake), gplans), rep
    )
    row["items_after_dedup"] = {
        "default": sum(len(p.items) for p in dglobal),
        "gen": sum(len(p.items) for p in gglobal),
    }
    del dplans, gplans, dglobal, gglobal

    # One rank's local load planning against those checkpoints' metadata.
    def gen_load(sim: _Sim, md) -> Any:
        p = ShardspecLoadPlanner(sim.spec, sim.mesh(other))
        p.set_up_planner(sim.state, md, False)
        return p.create_local_plan()

    row["local_load_gen"], _ = _best(uncached(lambda: gen_load(common, gmeta)), rep)
    row["local_load_gen_cached"], _ = _best(lambda: gen_load(common, gmeta), rep)
    row["local_load_default"], _ = _best(lambda: common.default_local_load(other, dmeta), rep)

    # The full state dict (with the fused w13), generated planner only.
    row["local_save_gen_full"], _ = _best(uncached(lambda: full.gen_local_plan(other)), rep)
    if not with_full:
        return row
    fplans = full.gen_local_plans()
    for r in _sample_ranks(world):
        _check_same(full.gen_local_plan(r), fplans[r], r)
    row["items"]["gen_full"] = sum(len(p.items) for p in fplans)
    ffake = full.mesh(0)
    row["global_gen_full"], (_, fmeta) = _best(
        global_plan(lambda: ShardspecSavePlanner(full.spec, ffake), fplans), rep
    )
    del fplans
    row["local_load_gen_full"], _ = _best(uncached(lambda: gen_load(full, fmeta)), rep)
    return row


def _check_same(real, simulated, rank: int) -> None:
    from shardspec.runtime.checkpoint.planners import _CHECK

    # The real plan also carries the rank's structure check (compared by the coordinator).
    data = {k: v for k, v in (real.planner_data or {}).items() if k != _CHECK}
    if real.items != simulated.items or data != simulated.planner_data:
        raise AssertionError(f"simulated plan of rank {rank} differs from the planner's")


def _log(log: Callable[[str], None] | None, row: dict) -> None:
    if log is not None:
        log(
            f"  world {row['world']}: create_global_plan default {row['global_default']:.3f} s, "
            f"gen {row['global_gen']:.3f} s; local save plan gen {row['local_save_gen']:.3f} s"
        )


def _clear_caches_dcp() -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    for name in dir(SavePlanner):
        if name.startswith("_cached_") and isinstance(getattr(SavePlanner, name), dict):
            getattr(SavePlanner, name).clear()


# ----------------------------------------------------------------------------- report

GB = 1e9


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.0f} ms" if s < 10 else f"{s:,.1f} s"


def io_report(res: dict) -> list[str]:
    times, sizes = res["times"], res["sizes"]
    out = []
    m = res["model"]
    params = res.get("params")
    out.append(
        f"Model: Llama {m} ({params:,} parameters), Adam: {'yes' if res['adam'] else 'no'}; "
        f"state dicts: full {sizes['full'] / GB:.3f} GB, common {sizes['common'] / GB:.3f} GB "
        f"(logical: every tensor at its global shape, once)."
    )
    out.append(
        f"{res['world']} gloo ranks on the CPU, mesh {res['mesh']}; {res['rounds']} timed rounds "
        "after 1 untimed round (warm-up, checks, byte counts), operations in alternating order; "
        "time per call is the slowest rank's, between barriers."
    )
    out.append("")
    cpu = res["cpu"]
    labels = {"default": "DCP default", "gen": "generated planner"}
    for op, temps in (("save", ("",)), ("load", (":warm", ":cold"))):
        for temp in temps:
            title = f"{op}{' (' + temp[1:] + ')' if temp else ''}"
            out.append(
                f"| {title} | state | GB/s best | GB/s median | time median | "
                "throughput vs default: best / median / paired | CPU s (all ranks), median "
                "| CPU vs default |"
            )
            out.append("|---|---|---:|---:|---:|---:|---:|---:|")
            base = times.get(f"{op}:common:default{temp}")
            base_cpu = cpu.get(f"{op}:common:default{temp}")
            for which, kind in SAVES:
                tag = f"{op}:{which}:{kind}{temp}"
                t, c = times[tag], cpu[tag]
                gbs = [sizes[which] / GB / x for x in t]
                ratio = cratio = "-"
                if which == "common" and kind != "default" and base and base_cpu:
                    paired = statistics.median(b / x for b, x in zip(base, t, strict=True))
                    ratio = (
                        f"{min(base) / min(t):.2f}x / "
                        f"{statistics.median(base) / statistics.median(t):.2f}x / {paired:.2f}x"
                    )
                    cratio = f"{statistics.median(c) / statistics.median(base_cpu):.2f}x"
                label = labels.get(kind, f"generated `{op}()`")
                out.append(
                    f"| {label} | {which} | {max(gbs):.2f} | {statistics.median(gbs):.2f} | "
                    f"{_ms(statistics.median(t))} | {ratio} | {statistics.median(c):.2f} | "
                    f"{cratio} |"
                )
            out.append("")
    out.append(
        "| state | planner | written per rank, max / mean (tensor bytes of the final plan) | "
        "max / mean | data files per rank, max / mean | .metadata | read from files per rank "
        "on load, max / mean (read items) | received over P2P per rank, max |"
    )
    out.append("|---|---|---:|---:|---:|---:|---:|---:|")
    for which, kind in SAVES:
        w = res["written"][f"save:{which}:{kind}"]
        r = res["read"][f"load:{which}:{kind}"]
        rb = [x["bytes"] for x in r]
        ri = [x["items"] for x in r]
        p2p_all = [x.get("p2p") for x in r]
        p2p = "n/a" if None in p2p_all else _mb(max(p2p_all))
        label = labels.get(kind, "generated save()/load()")
        out.append(
            f"| {which} | {label} | {_mb(max(w['plan']))} / {_mb(_mean(w['plan']))} | "
            f"{max(w['plan']) / _mean(w['plan']):.3f} | "
            f"{_mb(max(w['files']))} / {_mb(_mean(w['files']))} | {_mb(w['metadata'])} | "
            f"{_mb(max(rb))} / {_mb(_mean(rb))} ({max(ri)}) | {p2p} |"
        )
    bad = {k: v for k, v in res["checks"].items() if v}
    out.append("")
    out.append(
        "Round-trip check (round 0: live tensors zeroed, loaded, compared with what was "
        f"saved, on every rank): {'all equal' if not bad else 'MISMATCH: ' + json.dumps(bad)}."
    )
    gen_bw = [x for x in res["written"]["save:common:gen"]["bytes_written()"]]
    plan_bw = res["written"]["save:common:gen"]["plan"]
    out.append(
        "`SavePlanner.bytes_written()` per rank (common): "
        + ", ".join(_mb(x) for x in gen_bw)
        + "; tensor bytes of its final plan: "
        + ", ".join(_mb(x) for x in plan_bw)
        + " (the difference: the optimizer's `step` scalars, which DCP's default handling writes)."
    )
    out.append(f"Set-up per rank (model, Adam step, state dicts): {res['setup_s']:.1f} s.")
    return out


def plan_report(rows: list[dict]) -> list[str]:
    out = []
    out.append(
        "| world | mesh | tensors | write items: default (after dedup) / gen | "
        "create_global_plan default | gen | gen / default time | gen, full |"
    )
    out.append("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
        full = _ms(r["global_gen_full"]) if "global_gen_full" in r else "not run"
        out.append(
            f"| {r['world']:,} | {mesh} | {r['tensors']['common']} ({r['tensors']['full']}) | "
            f"{r['items']['default']:,} ({r['items_after_dedup']['default']:,}) / "
            f"{r['items']['gen']:,} | {_ms(r['global_default'])} | {_ms(r['global_gen'])} | "
            f"{r['global_gen'] / r['global_default']:.2f}x | {full} |"
        )
    out.append("")
    out.append(
        "| world | local save plan, default | gen: new structure (cold caches) / same "
        "structure again | gen, full | local load plan, default | gen: new / again | "
        "gen, full | pickled local plan, default / gen |"
    )
    out.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        lf = _ms(r["local_load_gen_full"]) if "local_load_gen_full" in r else "not run"
        out.append(
            f"| {r['world']:,} | {_ms(r['local_save_default'])} | {_ms(r['local_save_gen'])} "
            f"({_ms(r['local_save_gen_cold'])}) / {_ms(r['local_save_gen_cached'])} | "
            f"{_ms(r['local_save_gen_full'])} | {_ms(r['local_load_default'])} | "
            f"{_ms(r['local_load_gen'])} / {_ms(r['local_load_gen_cached'])} | {lf} | "
            f"{r['plan_pickle_bytes']['default'] / 1e3:.1f} / "
            f"{r['plan_pickle_bytes']['gen'] / 1e3:.1f} kB |"
        )
    return out


def machine(path: str) -> str:
    import torch

    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    disk = "?"
    with contextlib.suppress(OSError), open("/proc/mounts", encoding="utf-8") as f:
        best = ""
        real = os.path.realpath(path)
        for line in f:
            dev, mnt, fs = line.split()[:3]
            if real.startswith(mnt) and len(mnt) >= len(best):
                best, disk = mnt, f"{dev} ({fs}, mounted on {mnt})"
    return (
        f"{os.cpu_count()} CPU cores ({cpu}), {platform.machine()}, "
        f"{_mem_gib():.0f} GiB RAM, Linux {platform.release()}, Python "
        f"{platform.python_version()}, torch {torch.__version__}; checkpoint folder on {disk}"
    )


def _mem_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--part", choices=("io", "plan", "all"), default="all")
    ap.add_argument("--rounds", type=int, default=5, help="timed I/O rounds (default 5)")
    ap.add_argument("--no-adam", action="store_true", help="model state only")
    ap.add_argument("--worlds", default=",".join(map(str, SIM_WORLDS)))
    ap.add_argument("--sim-repeat", type=int, default=3, help="best of N for planning times")
    ap.add_argument(
        "--full-max-world",
        type=int,
        default=4096,
        help="largest world for the full (w13) state dict's global plan",
    )
    ap.add_argument("--workdir", help="checkpoint folder (default: a new one under $TMPDIR)")
    ap.add_argument(
        "--profile",
        help="cProfile rank 0 in round 1 of these comma-separated operations, e.g. "
        "save:common:gen,load:common:default:warm",
    )
    ap.add_argument("--json", help="also write the raw results here")
    args = ap.parse_args(argv)

    args_text = argv if argv is not None else sys.argv[1:]
    started = time.time()
    load0 = os.getloadavg()[0]
    workdir = args.workdir or tempfile.mkdtemp(prefix="shardspec-bench-ckpt-")
    lines = [
        f"Command: `python -m bench.bench_checkpoint {' '.join(args_text)}`".rstrip() + "  ",
        f"Machine: {machine(workdir)}  ",
        f"Date: {datetime.date.today().isoformat()}; code: {_revision()}  ",
    ]
    raw: dict[str, Any] = {}
    body: list[str] = []
    if args.part in ("io", "all"):
        print("I/O part ...", file=sys.stderr)
        res = run_io(
            rounds=args.rounds, adam=not args.no_adam, workdir=workdir, profile=args.profile
        )
        res["params"] = _n_params(res["model"])
        res["mesh"] = "dp_shard 2 x tp 2"
        raw["io"] = res
        body += ["", "#### Save and load throughput", "", *io_report(res)]
        for tag, text in (res.get("profile") or {}).items():
            body += ["", f"cProfile of rank 0, round 1, `{tag}`:", "", "```", text.rstrip(), "```"]
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.part in ("plan", "all"):
        print("planning part ...", file=sys.stderr)
        worlds = [int(x) for x in args.worlds.split(",") if x]
        rows = run_plan(
            worlds=worlds,
            repeat=args.sim_repeat,
            full_max_world=args.full_max_world,
            log=lambda s: print(s, file=sys.stderr),
        )
        raw["plan"] = rows
        body += ["", "#### Planning time against simulated world size", ""]
        body.append(
            f"Model: Llama 3 8B shapes ({SIM_MODEL}), model state only, "
            f"{_n_params(SIM_MODEL) / 1e9:.2f}B parameters; tp {SIM_TP}, "
            f"dp_shard = world / {SIM_TP}. "
            f"Best of {args.sim_repeat} (one run above 512 ranks), "
            "in one process, GC on. `common` as above; `full` (generated only) adds w13."
        )
        body.append("")
        body += plan_report(rows)
    load1 = os.getloadavg()[0]
    lines.append(
        f"Load: 1-minute load average {load0:.1f} before, {load1:.1f} after; "
        f"whole run {time.time() - started:.0f} s  "
    )
    print("\n".join(lines + body))
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1, default=str), encoding="utf-8")
    return 0


def _revision() -> str:
    """The checkout's commit, and whether the runtime under test has uncommitted changes."""
    import subprocess

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "shardspec", "generated", "examples")
    return f"commit {head}" + (" (shardspec/examples with uncommitted changes)" if dirty else "")


def _n_params(cfg: dict[str, int]) -> int:
    import torch

    from examples.models.llama import Llama, LlamaConfig

    with torch.device("meta"):
        model = Llama(LlamaConfig(**cfg))
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    sys.exit(main())
