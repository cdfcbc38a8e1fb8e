"""DCP planners generated modules expose, and ``save``/``load`` helpers around them.

``SavePlanner`` and ``LoadPlanner`` subclass DCP's default planners. They replace every
parameter-shaped entry of the state dict (parameters, and optimizer states that follow them)
by its canonical units (see :mod:`shardspec.runtime.canonical`); everything else (scalars,
param groups, other objects) goes through DCP's default handling.

* Writers are chosen statically, balanced by bytes: a replicated chunk is written once.
* Plans are cached under a fingerprint of the structure and the mesh, in a cache key of
  their own (per spec, planner role and fingerprint), so a new item, a dtype change or a
  new mesh re-plans, and model and optimizer planners never share a cache.
* Loading validates the whole checkpoint before a byte is read and reports every missing,
  unexpected or mismatched key in one error. ``load`` reads into staging buffers and
  changes the live tensors only after every rank's reads succeeded.
* The canonical plan (units, writers, fingerprint) is cached per spec under the state
  dict's structure, the mesh and the rank, so repeated saves and loads only bind tensors;
  the coordinator checks the global plan in linear time (shardspec's chunks form a grid),
  where DCP's own check is quadratic for FSDP x TP layouts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import os
import shutil
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from shardspec.runtime.canonical import (
    CanonicalPlan,
    Unit,
)
from shardspec.runtime.checkpoint.global_plan import validate_global_plan
from shardspec.runtime.checkpoint.integrity import ChecksumError, ChecksumReader, ChecksumWriter
from shardspec.runtime.spec import CompiledSpec
from shardspec.runtime.units import (  # noqa: F401  (re-exported: the checkpoint API)
    CheckpointError,
    Names,
    _flat,
    canonical_plan,
    clear_plan_cache,
    ignored_key,
    mesh_and_rank,
    rename_path,
    unit_commit,
    unit_commit_box,
    unit_data,
)

MARKER = ".shardspec.json"


class _Sink(torch.Tensor):
    """A staging tensor without storage. ``FileSystemReader`` copies each chunk it read
    into the tensor ``resolve_tensor`` returns, then calls ``commit_tensor`` with it; a
    sink keeps a reference to the chunk instead of copying it, so the chunk as read is the
    staged copy (one copy of every byte less, and no separate buffer to fault in). Any
    other use raises: only readers known to do just that get sinks."""

    source: torch.Tensor | None

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype) -> _Sink:
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="cpu")
        t.source = None
        return t

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
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


# ----------------------------------------------------------------------------- save


def _stored_mappings(plan: CanonicalPlan, mappings: dict[str, tuple]) -> dict[str, tuple]:
    """DCP's flat-key -> object-path mappings for the stored (canonical) keys."""
    out = dict(mappings)
    for old, new in plan.renamed.items():
        if old in out:
            out[new] = out.pop(old)
    for unit in plan.units:
        path = mappings.get(unit.source)
        if path is not None:
            a, b, name = plan.paths[unit.key]
            out[unit.key] = rename_path(path, unit.source, a, b, name)
    stored = {u.key for u in plan.units}
    for unit in plan.units:
        if unit.source not in stored:  # a source stored under its own name keeps its path
            out.pop(unit.source, None)
    return out


# Where a local save plan carries its structure check (see ShardspecSavePlanner): a key no
# flattened state dict has, taken out again before DCP's global planning.
_CHECK = "\x00shardspec:check"


@dataclasses.dataclass(frozen=True)
class _Check:
    """What the coordinator compares across ranks before planning a save: the rank's
    pipeline stage, its structure fingerprint, a digest of its writer choice, and (pipeline
    stages only) hashes of its entries that are neither tensors nor named by a parameter."""

    stage: int | None
    fingerprint: str
    writers: str
    shared: dict[str, str] | None = None
    # A strict planner's state-dict entries that nothing in the spec covers (described):
    # the coordinator refuses the save if any rank has one.
    uncovered: tuple[str, ...] = ()


def _writers_digest(plan: CanonicalPlan) -> str:
    """A digest of the static writer choice (cached on the plan, which is itself cached per
    structure)."""
    digest = plan.__dict__.get("_shardspec_writers")
    if digest is None:
        import hashlib

        digest = hashlib.sha256(repr(sorted(plan.writer.items())).encode()).hexdigest()[:16]
        plan.__dict__["_shardspec_writers"] = digest
    return digest


def _shared_hashes(rest: Mapping[str, Any]) -> dict[str, str]:
    """Hashes of the entries without a parameter name that are not tensors (an optimizer's
    ``param_groups`` list, a step counter): compared across pipeline stages."""
    import hashlib
    import pickle

    mine = {}
    for key, value in rest.items():
        if isinstance(value, torch.Tensor):
            continue
        try:
            blob = pickle.dumps(value)
        except Exception:  # unpicklable: DCP would fail on it anyway
            continue
        mine[key] = hashlib.sha256(blob).hexdigest()
    return mine


def _agree(checks: list[_Check | None]) -> dict[int | None, str]:
    """The coordinator's structure check over every rank's :class:`_Check` (in process-group
    rank order). Refuses to save when ranks' state dicts differ in structure (they would
    choose writers differently and some chunks would be written by nobody), or, with
    pipeline stages, when stages hold different values under one shared key (the other
    stages' values would be lost: a ``param_groups`` list names only its own stage's
    parameters). Returns each pipeline stage's structure fingerprint (one entry, under
    None, without pipeline stages)."""
    first: dict[Any, tuple[int, tuple[str, str]]] = {}
    odd = []
    for r, check in enumerate(checks):
        if check is None:  # a planner of another kind: nothing to compare
            continue
        lead = first.setdefault(check.stage, (r, (check.fingerprint, check.writers)))
        if lead[1] != (check.fingerprint, check.writers):
            odd.append((r, lead[0]))
    if odd:
        where = ", ".join(f"rank {r} differs from rank {lead}" for r, lead in odd[:8])
        raise CheckpointError(
            "ranks disagree on the checkpoint's structure (different keys, shapes or dtypes "
            f"in their state dicts; {where}), so they would choose different writers; "
            "nothing was saved"
        )
    uncovered = sorted({u for c in checks if c is not None for u in c.uncovered})
    if uncovered:
        raise CheckpointError(uncovered_message(uncovered, "nothing was saved"))
    every = [c.shared for c in checks if c is not None and c.shared is not None]
    differ = sorted(
        {k for d in every for k, h in d.items() if any(o.get(k, h) != h for o in every)}
    )
    if differ:
        raise CheckpointError(
            f"{len(differ)} entr{'y' if len(differ) == 1 else 'ies'} without a parameter name "
            f"differ between pipeline stages ({', '.join(differ[:4])}); a checkpoint stores "
            "such an entry once, so the other stages' values would be lost; nothing was "
            "saved. For an optimizer, save get_state_dict(..., options=StateDictOptions("
            "flatten_optimizer_state_dict=True)), which names every entry by its parameter"
        )
    return {stage: lead[1][0] for stage, lead in first.items()}


def uncovered_message(entries: list[str], outcome: str) -> str:
    """Why a save refuses (or, ``strict=False``, warns about) ``entries``."""
    n = len(entries)
    shown = "; ".join(entries[:8]) + (f"; and {n - 8} more" if n > 8 else "")
    return (
        f"{n} state-dict entr{'y' if n == 1 else 'ies'} of the model that no rule, ignore or "
        f"buffer of the manifest covers ({outcome}): {shown}. DCP would store each whole, "
        "outside the spec's layout, and a key a state-dict hook writes is no parameter a "
        "load can reshard. Save the parameters under their own names (a state dict of "
        "model.named_parameters() and the persistent buffers, without the hooks' keys), "
        "add a rule or an `ignore` for them, or pass strict=False to save them as they are "
        "with a warning"
    )


class UncoveredEntriesWarning(UserWarning):
    """``save(..., strict=False)`` stored state-dict entries that nothing in the spec
    covers (each whole, as DCP stores any tensor)."""


@functools.lru_cache(maxsize=1)
def _dcp_caches_pending_plans() -> bool:
    """Whether the installed DCP caches local plans the way this planner relies on."""
    import inspect

    cache = getattr(SavePlanner, "_cached_save_plan", None)
    try:
        promotes = "_pending_local_plan" in inspect.getsource(DefaultSavePlanner.finish_plan)
    except (OSError, TypeError):
        promotes = False
    return isinstance(cache, dict) and promotes


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


class ShardspecSavePlanner(DefaultSavePlanner):
    """Saves a state dict in the spec's canonical, topology-independent layout.

    ``role`` names the cache: give the model and the optimizer planners different roles
    if they are used for separate saves (their fingerprints differ anyway).

    The planner runs no collective of its own: every rank's structure check (fingerprint,
    writer choice, pipeline stage, shared entries) travels in its local plan's
    ``planner_data`` and the coordinator compares them in ``create_global_plan``, so it
    works on whatever process group DCP is given (``dcp.async_save(...,
    process_group=...)`` while training runs collectives on the default group).
    """

    def __init__(
        self,
        spec: CompiledSpec,
        mesh: Any = None,
        *,
        role: str = "state",
        enable_plan_caching: bool = True,
        strict: bool = True,
    ) -> None:
        # Plan caching needs DCP's cache protocol (a class-level cache of local plans that
        # finish_plan fills from a pending plan, as in torch 2.13). Where the installed DCP
        # differs, plans are simply never reused: slower to plan, never stale.
        caching = enable_plan_caching and _dcp_caches_pending_plans()
        try:
            super().__init__(enable_plan_caching=caching)
        except TypeError:  # a DCP without plan caching at all
            super().__init__()
            self._enable_plan_caching = False
        self.spec = spec
        self.role = role
        self.strict = strict
        self._mesh_arg = mesh
        self._staged: dict[str, torch.Tensor] | None = None
        self._pooled: list[torch.Tensor] = []
        self._set_up_done = False

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.is_coordinator = is_coordinator
        if self._set_up_done:  # stage() ran: planned and copied in the caller's thread
            self._set_up_done = False
            return
        self._set_up(state_dict)

    def _set_up(self, state_dict: Mapping[str, Any]) -> None:
        flat, mappings = _flat(state_dict)
        self.lmesh, self.rank = mesh_and_rank(self.spec, self._mesh_arg)
        self.canon, rest, self.local = canonical_plan(self.spec, self.lmesh, self.rank, flat)
        self.mappings = _stored_mappings(self.canon, mappings)
        self.state_dict = rest
        self._staged = None
        stage = self.canon.stage
        uncovered = self.canon.uncovered
        if uncovered and not self.strict:
            warnings.warn(
                uncovered_message(list(uncovered), "saved as they are: strict=False"),
                UncoveredEntriesWarning,
                stacklevel=2,
            )
        self._check = _Check(
            stage,
            self.canon.fingerprint,
            _writers_digest(self.canon),
            _shared_hashes(rest) if stage is not None else None,
            uncovered if self.strict else (),
        )
        # Until the coordinator has compared every rank's: this rank's own.
        self.stage_fingerprints = {stage: self.canon.fingerprint}
        # A cache of its own: spec, role and structure fingerprint (keys, shapes, dtypes,
        # chunk offsets, mesh). DCP's default key is the class name, shared by every
        # instance, and its plan comparison ignores dtypes.
        self._cached_plans_key = f"shardspec:{self.spec.name}:{self.role}:{self.canon.fingerprint}"

    def stage(self, state_dict: Mapping[str, Any]) -> None:
        """Plan this rank's part of a save of ``state_dict`` and copy what it writes to CPU
        memory (pinned memory from CUDA; only the chunks this rank writes, a replicated chunk
        by its one writer), so that the live tensors may change as soon as this returns.
        The next ``set_up_planner`` (DCP's, in the thread that writes) keeps this plan.
        Runs no collective."""
        self._set_up(state_dict)
        staged: dict[str, torch.Tensor] = {}
        for unit in self.canon.units:
            if unit.empty or self.canon.writer_of(unit.key, unit.offsets, unit.replicas) != (
                self.rank
            ):
                continue
            _, tensor = self.local[unit.key]
            staged[unit.key] = _cpu_copy(unit_data(unit, tensor), tensor, self._pooled)
        self.state_dict = {k: _stage_value(v) for k, v in self.state_dict.items()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the pinned copies are complete
        self._staged = staged
        self._set_up_done = True

    def release_staging(self) -> None:
        """Drop the staged copies (the save is over), keeping their buffers for the next
        asynchronous save."""
        self._staged = None
        self.state_dict = {}
        pooled, self._pooled = self._pooled, []
        _give(pooled)

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for unit in self.canon.units:
            if unit.empty or self.canon.writer_of(unit.key, unit.offsets, unit.replicas) != (
                self.rank
            ):
                continue
            _, tensor = self.local[unit.key]
            items.append(
                WriteItem(
                    index=MetadataIndex(unit.key, torch.Size(unit.offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(
                            offsets=torch.Size(unit.offsets), sizes=torch.Size(unit.sizes)
                        ),
                        properties=TensorProperties(dtype=tensor.dtype),
                        size=torch.Size(unit.shape),
                    ),
                )
            )
        rest = create_default_local_save_plan(self.state_dict, self.is_coordinator)
        plan = SavePlan(items + list(rest.items), planner_data=self.mappings)
        self.plan = plan
        checked = {**self.mappings, _CHECK: self._check}
        if self._enable_plan_caching:
            from torch.distributed.checkpoint.planner_helpers import _compare_save_plans

            cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)  # type: ignore[attr-defined]
            if cached is not None and _compare_save_plans(plan, cached):
                # Unchanged: DCP sends no items, but the coordinator still checks structure.
                return SavePlan([], planner_data={_CHECK: self._check}, usable=False)
            self._pending_local_plan = plan
        return dataclasses.replace(plan, planner_data=checked)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """The coordinator: compare every rank's structure check (:func:`_agree`; a
        mismatch fails the save on every rank with a :class:`CheckpointError`, before a byte
        is written), then DCP's global planning on the plans without it."""
        checks: list[_Check | None] = []
        plans: list[SavePlan] = []
        for plan in all_plans:
            data = plan.planner_data
            check = None
            if isinstance(data, dict) and _CHECK in data:
                data = dict(data)
                check = data.pop(_CHECK)
                if not data and not plan.usable:
                    data = None
                plan = dataclasses.replace(plan, planner_data=data)
            checks.append(check)
            plans.append(plan)
        self.stage_fingerprints = _agree(checks)
        return super().create_global_plan(plans)

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """The coordinator's step, as DCP's (dedup, metadata, merged object paths), with
        :func:`validate_global_plan` in place of DCP's quadratic check. DCPs without this
        method (their ``create_global_plan`` does it inline) keep their own code."""
        from collections import ChainMap

        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        dedup = getattr(self, "_dedup_save_plans", None)
        with _no_gc():  # a million small objects at scale: no full collections meanwhile
            if dedup is None:  # DCPs with _create_global_plan have it
                from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

                deduped = dedup_save_plans(all_plans)
            else:
                deduped = dedup(all_plans)
            global_plan, metadata = create_default_global_save_plan(deduped)
            if getattr(self, "flatten_state_dict", True):
                merged = dict(ChainMap(*(p.planner_data for p in global_plan)))
                metadata = dataclasses.replace(metadata, planner_data=merged)
            errors = validate_global_plan(global_plan, metadata)
        if errors:
            summary = "; ".join(errors)
            if len(summary) > 500:
                summary = summary[:500] + "... (truncated)"
            raise ValueError(f"Failed to validate global plan: {summary}")
        return global_plan, metadata

    def resolve_data(self, write_item: WriteItem):
        if self._staged is not None:
            staged = self._staged.get(write_item.index.fqn)
            if staged is not None:
                return staged
        hit = self.local.get(write_item.index.fqn)
        if hit is not None:
            unit, tensor = hit
            return unit_data(unit, tensor)
        return super().resolve_data(write_item)

    def bytes_written(self) -> int:
        """Bytes of tensor data this rank writes under the current plan."""
        return sum(
            u.nbytes
            for u in self.canon.units
            if not u.empty and self.canon.writer_of(u.key, u.offsets, u.replicas) == self.rank
        )


# ----------------------------------------------------------------------------- load


class ShardspecLoadPlanner(DefaultLoadPlanner):
    """Loads a canonical checkpoint into any mesh the spec allows, validating first.

    ``partial=True`` allows keys missing from the checkpoint (they keep their values; see
    ``skipped``) and keys the state dict does not ask for. ``staging=True`` reads every
    chunk into a separate buffer, and ``commit()`` then copies them into the live tensors
    (``load`` does this once every rank's reads succeeded). With ``capture`` (set by
    ``load`` where the reader is DCP's ``FileSystemReader``) the chunks as read are those
    buffers (see :class:`_Sink`). With ``staging=False`` (a plain
    ``dcp.load(..., planner=LoadPlanner())``) chunks land in the live tensors as they arrive
    (units cut in several runs through a short-lived buffer per read).
    """

    def __init__(
        self,
        spec: CompiledSpec,
        mesh: Any = None,
        *,
        partial: bool = False,
        staging: bool = False,
    ) -> None:
        super().__init__(allow_partial_load=partial)
        self.spec = spec
        self._mesh_arg = mesh
        self.partial = partial
        self.staging = staging
        # Set by load() where the reader fills sinks: staged chunks are the tensors as read.
        self.capture = False
        self._buffers: dict[str, torch.Tensor] = {}
        self._rest_buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # Captured chunks: (stored key, dest_offsets, lengths) -> data, in read order.
        self._pieces: dict[tuple[str, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
        # Non-tensor entries as read (staging): set in the state dict at commit, so a failed
        # load leaves them as they were too (a learning rate, a step counter).
        self._objects: list[tuple[str, Any]] = []
        self.skipped: list[str] = []

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator=False):
        if metadata is None:
            raise CheckpointError("the checkpoint has no metadata")
        self.original_state_dict = state_dict
        flat, self.flat_mappings = _flat(state_dict)
        self.lmesh, self.rank = mesh_and_rank(self.spec, self._mesh_arg)
        self.canon, rest, self.local = canonical_plan(
            self.spec, self.lmesh, self.rank, flat, saving=False
        )
        self.stored_to_own = {new: old for old, new in self.canon.renamed.items()}
        self.state_dict = rest  # keyed by stored names
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self._legacy, self.skipped = validate(
            self.canon, rest, metadata, self.spec, partial=self.partial
        )

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        md = self.metadata.state_dict_metadata
        items: list[ReadItem] = []
        skipped = set(self.skipped)
        for unit in self.canon.units:
            if unit.empty or unit.key in skipped:
                continue
            chunk = ChunkStorageMetadata(torch.Size(unit.offsets), torch.Size(unit.sizes))
            if unit.key in md:
                items.extend(create_read_items_for_chunk_list(unit.key, md[unit.key], [chunk]))
            else:
                items.extend(self._legacy_reads(unit))
        present = {k: v for k, v in self.state_dict.items() if k in md}
        rest_plan = create_default_local_load_plan(present, self.metadata, False)
        return LoadPlan(items + list(rest_plan.items))

    def _legacy_reads(self, unit: Unit) -> list[ReadItem]:
        """Read a component out of a fused tensor that DCP's default planner saved whole
        under the parameter's own key: one read per group the chunk touches."""
        assert unit.fused is not None and self.metadata is not None
        source = self._legacy[unit.key]
        md = self.metadata.state_dict_metadata[source]
        dim, where, _ = unit.fused
        items = []
        pos = 0  # position in the component's own numbering
        for start, length in where:
            lo = max(unit.offsets[dim], pos)
            hi = min(unit.offsets[dim] + unit.sizes[dim], pos + length)
            if lo < hi:
                offs, sizes = list(unit.offsets), list(unit.sizes)
                offs[dim], sizes[dim] = start + lo - pos, hi - lo
                chunk = ChunkStorageMetadata(torch.Size(offs), torch.Size(sizes))
                for it in create_read_items_for_chunk_list(source, md, [chunk]):
                    dest = list(it.dest_offsets)
                    dest[dim] += lo - unit.offsets[dim]
                    items.append(
                        dataclasses.replace(
                            it,
                            dest_index=MetadataIndex(unit.key, torch.Size(unit.offsets)),
                            dest_offsets=torch.Size(dest),
                        )
                    )
            pos += length
        return items

    def _buffer(self, key: str) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None:
            unit, tensor = self.local[key]
            if self.staging or unit.runs is not None:
                buf = torch.empty(unit.sizes, dtype=tensor.dtype, device=tensor.device)
            else:
                buf = tensor
            self._buffers[key] = buf
        return buf

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.local:
            return self._buffer(index.fqn)
        from torch.distributed.checkpoint.utils import find_state_dict_object

        target = find_state_dict_object(self.state_dict, index)
        if not self.staging:
            return target
        hit = self._rest_buffers.get(index.fqn)
        if hit is None:
            hit = (torch.empty_like(target), target)
            self._rest_buffers[index.fqn] = hit
        return hit[0]

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        key = read_item.dest_index.fqn
        hit = self.local.get(key)
        if hit is not None:
            unit, live = hit
            if self.staging and self.capture:
                return _Sink(tuple(read_item.lengths), live.dtype)
            if not self.staging and unit.runs is not None:
                # A unit cut in runs: a buffer for this one read, committed and dropped
                # in commit_tensor (short-lived, so the allocator reuses its memory).
                return torch.empty(tuple(read_item.lengths), dtype=live.dtype, device=live.device)
        return super().resolve_tensor(read_item)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        key = read_item.dest_index.fqn
        if isinstance(tensor, _Sink):
            data = tensor.source
            if data is None:
                raise CheckpointError(f"{key}: the storage reader left a chunk unread")
            if 2 * data.numel() * data.element_size() < data.untyped_storage().nbytes():
                data = data.clone()  # a small part of a large stored chunk: hold only it
            self._pieces[(key, tuple(read_item.dest_offsets), tuple(read_item.lengths))] = data
            return
        if key in self.local and not self.staging:
            unit, live = self.local[key]
            if unit.runs is not None:  # the read's buffer, into the unit's runs
                unit_commit_box(unit, live, read_item.dest_offsets, read_item.lengths, tensor)

    def load_bytes(self, read_item: ReadItem, value) -> None:

        stored = read_item.dest_index.fqn
        obj = torch.load(value, weights_only=False)
        if self.staging:
            self._objects.append((stored, obj))
        else:
            self._set_object(stored, obj)

    def _set_object(self, stored: str, obj: Any) -> None:
        from torch.distributed.checkpoint._nested_dict import set_element

        own = self.stored_to_own.get(stored, stored)
        path = self.flat_mappings.get(own)
        if path is None:
            self.state_dict[stored] = obj
        else:
            set_element(self.original_state_dict, path, obj)

    def commit(self) -> None:
        """Copy staged chunks into the live tensors (after every rank's reads succeeded)."""
        for key, buf in self._buffers.items():
            unit, live = self.local[key]
            unit_commit(unit, live, buf)
        for (key, offsets, lengths), data in self._pieces.items():
            unit, live = self.local[key]
            unit_commit_box(unit, live, offsets, lengths, data)
        for stored, obj in self._objects:
            self._set_object(stored, obj)
        self._objects.clear()
        for buf, target in self._rest_buffers.values():
            target.copy_(buf)
        self._buffers.clear()
        self._pieces.clear()
        self._rest_buffers.clear()


def validate(
    canon: CanonicalPlan,
    rest: Mapping[str, Any],
    metadata: Metadata,
    spec: CompiledSpec,
    *,
    partial: bool,
) -> tuple[dict[str, str], list[str]]:
    """Compare what the state dict asks for with the checkpoint's metadata, before any
    read. Returns fused-tensor fallbacks (stored key -> key saved whole) and the keys that
    a partial load skips. Raises one :class:`CheckpointError` naming every problem."""
    md = metadata.state_dict_metadata
    problems: list[str] = []
    legacy: dict[str, str] = {}
    skipped: list[str] = []
    expected: set[str] = set()
    seen: set[str] = set()
    for unit in canon.units:
        if unit.key in seen:
            continue
        seen.add(unit.key)
        have = md.get(unit.key)
        if have is None and unit.fused is not None:
            whole = md.get(unit.source)
            if isinstance(whole, TensorStorageMetadata) and tuple(whole.size) == unit.fused[2]:
                legacy[unit.key] = unit.source
                expected.add(unit.source)
                have = whole
        else:
            expected.add(unit.key)
        if have is None:
            (skipped if partial else problems).append(
                unit.key if partial else f"missing: {unit.key} (global shape {list(unit.shape)})"
            )
            continue
        if not isinstance(have, TensorStorageMetadata):
            problems.append(f"{unit.key}: stored as bytes, but the state dict has a tensor")
            continue
        want_shape = unit.fused[2] if unit.key in legacy and unit.fused else unit.shape
        if tuple(have.size) != tuple(want_shape):
            problems.append(
                f"{unit.key}: global shape {list(have.size)} in the checkpoint, "
                f"{list(want_shape)} in the state dict"
            )
        dtype = canon.dtypes.get(unit.key)
        if dtype is not None and have.properties.dtype != dtype:
            problems.append(
                f"{unit.key}: dtype {have.properties.dtype} in the checkpoint, "
                f"{dtype} in the state dict"
            )
    for key, value in rest.items():
        expected.add(key)
        have = md.get(key)
        if have is None:
            if not partial:
                problems.append(f"missing: {key}")
            continue
        if isinstance(value, torch.Tensor) and isinstance(have, TensorStorageMetadata):
            if tuple(have.size) != tuple(value.shape):
                problems.append(
                    f"{key}: shape {list(have.size)} in the checkpoint, "
                    f"{list(value.shape)} in the state dict"
                )
            elif have.properties.dtype != value.dtype:
                problems.append(
                    f"{key}: dtype {have.properties.dtype} in the checkpoint, "
                    f"{value.dtype} in the state dict"
                )
    if not partial:
        for key in sorted(md):
            if key in expected or key in canon.keys or ignored_key(spec, key):
                continue
            if canon.foreign and _mentions(key, canon.foreign):
                continue  # another pipeline stage's: its ranks load it
            problems.append(f"unexpected: {key} (in the checkpoint, not in the state dict)")
    if problems:
        raise CheckpointError(
            f"the checkpoint does not match the state dict ({len(problems)} problem(s)); "
            "nothing was read:\n  " + "\n  ".join(problems)
        )
    return legacy, skipped


# ----------------------------------------------------------------------------- helpers


def _mentions(key: str, names: frozenset[str]) -> bool:
    """Whether a dot-bounded part of flat key ``key`` is one of ``names``, or a component
    (``<name>.<component>``) of one."""
    parts = key.split(".")
    for i in range(len(parts)):
        for j in range(i + 1, len(parts) + 1):
            if ".".join(parts[i:j]) in names:
                return True
    return False


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


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


# ----------------------------------------------------------------------------- folders

# A save in progress: written into ``<path>.partial`` before any data, removed once the
# completion marker is there. A folder that has it is never loaded as a checkpoint.
SAVING = ".shardspec-saving"

# Test hook: called with the name of each step of the save protocol (see save()).
_fault_point: Any = None


def _point(name: str) -> None:
    if _fault_point is not None:
        _fault_point(name)


def _folder_state(path: str) -> str:
    """``missing``; ``complete`` (DCP's ``.metadata`` and shardspec's completion marker);
    ``saving`` (a shardspec save in progress or interrupted: no completion marker, the
    in-progress marker); ``foreign`` (a DCP checkpoint without shardspec's markers, as
    ``dcp.save`` writes); ``empty``; ``other`` (anything else)."""
    if not os.path.lexists(path):
        return "missing"
    if not os.path.isdir(path):
        return "other"
    names = set(os.listdir(path))
    if MARKER in names and ".metadata" in names:
        return "complete"
    if SAVING in names:
        return "saving"
    if MARKER in names:
        return "other"
    if ".metadata" in names:
        return "foreign"
    return "other" if names else "empty"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json(path: str, value: Any) -> None:
    """Write ``path`` atomically (a temporary file, fsynced, renamed over it)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# Written into the checkpoint at ``path`` just before a save renames it to ``<path>.old``:
# recovery restores or removes only a ``<path>.old`` that a save set aside (or that is a
# shardspec checkpoint), never a user's own folder of that name.
REPLACED = ".shardspec-replaced"


def _set_aside(path: str, old: str) -> None:
    """Mark the checkpoint at ``path`` as set aside by a save, and rename it to ``old``."""
    with open(os.path.join(path, REPLACED), "w", encoding="utf-8") as f:
        f.write("set aside by a shardspec save; removed when the save completes\n")
    os.rename(path, old)


def _ours_old(old: str) -> bool:
    """Whether ``old`` is a checkpoint that a save set aside (see :data:`REPLACED`)."""
    try:
        names = set(os.listdir(old))
    except OSError:
        return False
    return REPLACED in names or (MARKER in names and ".metadata" in names)


def _recover(path: str) -> list[str]:
    """Finish or undo what a save of ``path`` that stopped part-way left (the coordinator,
    before a save or load of ``path``; see :func:`save` for the steps). Returns what it
    did, one sentence each:

    * ``<path>.partial`` complete (marked) but not moved into place: moved into place,
      the checkpoint that was at ``path`` removed (the save stopped after marking);
    * ``path`` missing and ``<path>.old`` a checkpoint a save set aside: restored (the
      save stopped between its two renames, before the new one was complete);
    * such a ``<path>.old`` beside a checkpoint at ``path``: removed (the save stopped
      after moving the new checkpoint into place).

    A ``<path>.old`` that no save set aside is left alone (and a save that would need its
    name is refused, by :func:`_prepare`)."""
    tmp, old = path + ".partial", path + ".old"
    done: list[str] = []
    here, new = _folder_state(path), _folder_state(tmp)
    checkpoint = ("complete", "foreign")
    parent = os.path.dirname(os.path.abspath(path))
    if new == "complete":
        if here not in ("missing", "empty", *checkpoint):
            raise CheckpointError(
                f"{tmp} holds a complete checkpoint that a save did not move into place, but "
                f"{path} exists and is not a checkpoint; move {path} away and retry"
            )
        if here != "missing":
            if os.path.lexists(old):
                if not _ours_old(old):
                    raise CheckpointError(
                        f"{tmp} holds a complete checkpoint that a save did not move into "
                        f"place, but {old}, which is not a save's, is in the way; move it away "
                        "and retry"
                    )
                shutil.rmtree(old)
            _set_aside(path, old)
        os.rename(tmp, path)
        _fsync_dir(parent)
        done.append(
            f"{tmp} held a complete checkpoint that its save had marked but not moved into "
            f"place: moved it to {path}"
            + ("" if here == "missing" else " (the checkpoint that was there is removed)")
        )
        if os.path.lexists(old) and _ours_old(old):
            shutil.rmtree(old)
        return done
    if not _ours_old(old):
        return done
    if here == "missing" and _folder_state(old) in checkpoint:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(old, REPLACED))
        os.rename(old, path)
        _fsync_dir(parent)
        done.append(
            f"{path} was missing and {old} held the previous checkpoint (a save stopped "
            f"between its renames): restored it to {path}"
        )
    elif here in checkpoint:
        shutil.rmtree(old)
        done.append(
            f"removed {old}, the previous checkpoint, which a save that moved the new one to "
            f"{path} had not removed yet"
        )
    return done


def _prepare(path: str) -> list[str]:
    """The coordinator, before any rank writes: recover what an interrupted save left,
    then create ``<path>.partial`` with the in-progress marker. Refuses (nothing changed) a
    ``path``, ``<path>.partial`` or ``<path>.old`` that is someone else's folder."""
    tmp, old = path + ".partial", path + ".old"
    done = _recover(path)
    here = _folder_state(path)
    if here == "other" or here == "saving":
        raise CheckpointError(
            f"{path} exists and is not a checkpoint (no DCP .metadata); nothing was saved: "
            "save elsewhere or remove it"
        )
    if os.path.lexists(old) and here != "missing":
        raise CheckpointError(
            f"{old} exists and no save set it aside; nothing was saved: move it away (a save "
            f"of {path} moves the checkpoint there while it replaces it)"
        )
    state = _folder_state(tmp)
    if state == "saving":
        shutil.rmtree(tmp)
        done.append(f"removed {tmp}, an unfinished save")
    elif state == "empty":
        os.rmdir(tmp)
    elif state != "missing":
        raise CheckpointError(
            f"{tmp} exists and is not a save in progress by shardspec (no {SAVING} marker); "
            f"nothing was saved: move it away (a save of {path} writes there first)"
        )
    os.makedirs(tmp)
    _write_json(
        os.path.join(tmp, SAVING),
        {"format": "shardspec-save-in-progress/1", "path": os.path.basename(path)},
    )
    return done


def _commit(path: str, marker: dict[str, Any]) -> None:
    """The coordinator, after every rank's data and DCP's ``.metadata`` are written: mark
    ``<path>.partial`` complete, then move it into place."""
    tmp, old = path + ".partial", path + ".old"
    _write_json(os.path.join(tmp, MARKER), marker)
    os.remove(os.path.join(tmp, SAVING))
    _fsync_dir(tmp)
    _point("marked")
    replacing = os.path.lexists(path)
    if replacing:
        _set_aside(path, old)  # _prepare made sure no other <path>.old is in the way
        _point("renamed-old")
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    _point("renamed-new")
    if replacing:
        shutil.rmtree(old)


def _report(done: list[str]) -> None:
    for line in done:
        warnings.warn(line, CheckpointRecoveryWarning, stacklevel=3)


class CheckpointRecoveryWarning(UserWarning):
    """A save or load finished or undid what an interrupted save of the same path left."""


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


# ----------------------------------------------------------------------------- async


_EXECUTOR: Any = None
_PENDING: weakref.WeakSet = weakref.WeakSet()


def _executor() -> Any:
    """One thread writes every asynchronous save, in the order they were started: the
    saves' collectives (on one process group) run in the same order on every rank."""
    global _EXECUTOR
    if _EXECUTOR is None:
        from concurrent.futures import ThreadPoolExecutor

        _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardspec-save")
    return _EXECUTOR


def wait_for_saves() -> None:
    """Wait until this process's asynchronous saves have finished (their errors stay with
    their futures). ``save`` and ``load`` call it first."""
    for future in list(_PENDING):
        try:
            future.exception()
        except BaseException:  # cancelled
            pass


# ----------------------------------------------------------------------------- save


def save(
    spec: CompiledSpec,
    state: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    mesh: Any = None,
    planner: ShardspecSavePlanner | None = None,
    process_group: Any = None,
    asynchronous: bool = False,
    strict: bool = True,
) -> Any:
    """Save ``state`` to ``path`` so that ``path`` always holds a complete checkpoint: the
    previous one or the new one, never a mix (see the README's "Checkpoints").

    Steps: (1) the coordinator (rank 0 of the process group) finishes or undoes what an
    interrupted save of ``path`` left (:func:`_recover`, reported as a
    :class:`CheckpointRecoveryWarning` on every rank and in the planner's ``recovered``)
    and creates ``<path>.partial`` with an in-progress marker; (2) ``dcp.save`` writes it
    (the structure check runs in DCP's plan exchange); (3) the coordinator writes the
    completion marker ``.shardspec.json``, removes the in-progress marker, renames
    ``path`` to ``<path>.old``, ``<path>.partial`` to ``path``, and removes
    ``<path>.old``; (4) every rank receives the coordinator's outcome, then a barrier on the
    process group (a rank that died after writing its data fails it on every survivor). A
    failure at any step is a :class:`CheckpointError` on every surviving rank.

    Every stored item's checksum is kept in the checkpoint's ``.metadata``
    (:class:`~shardspec.runtime.checkpoint.integrity.ChecksumWriter`); :func:`load` verifies
    them, and
    plain ``dcp.load`` reads the checkpoint as any other.

    ``process_group``: the group DCP and the protocol use (every rank of the job, in rank
    order); default the default group, or :func:`checkpoint_group` when asynchronous.

    ``asynchronous=True`` plans this rank's part and copies what it writes to CPU memory
    (pinned from CUDA) before returning, so training may change the parameters at once;
    the rest runs in a background thread on the process group (never the default group,
    unless given). Returns a :class:`concurrent.futures.Future` (like ``dcp.async_save``):
    ``result()`` waits until the checkpoint is complete at ``path`` and returns the planner,
    or raises the save's :class:`CheckpointError`. Otherwise returns the planner.

    ``strict`` (for the planner made here; a given planner keeps its own): a tensor of the
    model's state that no rule, ignore or buffer of the manifest covers (a key a state-dict
    hook writes in place of a parameter, say) fails the save on every rank before a byte
    is written; ``strict=False`` saves it whole, as DCP does, with an
    :class:`UncoveredEntriesWarning`."""
    path = os.fspath(path)
    planner = planner or ShardspecSavePlanner(spec, mesh, strict=strict)
    if not asynchronous:
        wait_for_saves()
        with _no_gc():
            return _save(spec, state, path, planner, process_group, _Roll(process_group))
    group = process_group if process_group is not None else checkpoint_group()
    try:
        planner.stage(state)
    except CheckpointError as e:
        _clear_frames(e)
        raise
    future = _executor().submit(_save_staged, spec, path, planner, group, _Roll(group))
    _PENDING.add(future)
    return future


def _save_staged(
    spec: CompiledSpec, path: str, planner: ShardspecSavePlanner, group: Any, roll: Any
) -> ShardspecSavePlanner:
    """An asynchronous save, in the background thread (the planner staged its part)."""
    try:
        return _save(spec, {}, path, planner, group, roll)
    finally:
        planner.release_staging()


def _save(
    spec: CompiledSpec,
    state: Mapping[str, Any],
    path: str,
    planner: ShardspecSavePlanner,
    group: Any,
    roll: _Roll,
) -> ShardspecSavePlanner:
    """:func:`save`'s steps, in the caller's thread or the background one."""
    roll.start()
    try:
        return _save_steps(spec, state, path, planner, group, roll)
    finally:
        roll.close()


def _save_steps(
    spec: CompiledSpec,
    state: Mapping[str, Any],
    path: str,
    planner: ShardspecSavePlanner,
    group: Any,
    roll: _Roll,
) -> ShardspecSavePlanner:
    tmp = path + ".partial"
    lead = _coordinator(group)
    planner.recovered = _exchange(
        group,
        _outcome(_prepare, path) if lead else None,
        f"saving {path} failed while preparing (before any data was written; {path} is unchanged)",
        roll,
    )
    _report(planner.recovered)
    _point("prepared")
    error: CheckpointError | None = None
    try:
        dcp.save(
            state,
            storage_writer=ChecksumWriter(tmp),
            planner=planner,
            process_group=group,
        )
    except CheckpointException as e:  # DCP's (a BaseException): every rank raises it
        ranks = sorted(getattr(e, "failures", {}) or [])
        where = f" on rank(s) {ranks}" if ranks else ""
        error = _failure(
            e,
            f"saving {path} failed{where}: {path} is unchanged, and the unfinished save "
            f"in {tmp} is removed:\n{e}",
        )
        if lead:  # every rank is past writing: nothing will land in the folder any more
            with contextlib.suppress(OSError):
                shutil.rmtree(tmp)
        # Every rank raised DCP's exception, so every rank is here: when any rank raises,
        # the unfinished folder is gone (a caller may look, or save again, at once).
        if _distributed(group):
            with contextlib.suppress(Exception):
                dist.barrier(group=group)
    except Exception as e:  # the backend's: a rank died or timed out in DCP's collectives
        error = _lost(
            e,
            f"saving {path} failed while writing ({path} is unchanged, and {tmp} is an "
            "unfinished save, which the next save removes)",
            roll,
        )
    if error is not None:  # raised here, out of the except clause: no context chained
        try:
            raise error
        finally:  # the traceback holds this frame: no cycle back through a local
            error = None
    _point("written")
    _exchange(
        group,
        _outcome(_commit, path, _marker(spec, planner)) if lead else None,
        f"saving {path} failed after writing its data: {path} holds the new checkpoint if "
        f"rank 0 moved it into place, else the previous one, and the next save or load of "
        f"{path} completes the move (see the README)",
        roll,
    )
    if _distributed(group):  # every rank is still there at the end, or every survivor says
        try:
            dist.barrier(group=group)
        except Exception as e:
            raise _lost(
                e,
                f"saving {path} completed (the new checkpoint is complete at {path}), but "
                "the save's final barrier failed",
                roll,
            ) from None
    roll.done()
    return planner


# ----------------------------------------------------------------------------- load


def _refuse_unfinished(path: str) -> None:
    """A folder a shardspec save has not marked complete is never loaded."""
    state = _folder_state(path)
    if state == "saving":
        raise CheckpointError(
            f"{path} is an unfinished save (it has the in-progress marker {SAVING} and no "
            f"completion marker {MARKER}); nothing was read"
        )
    if state != "complete" and path.rstrip("/").endswith(".partial"):
        raise CheckpointError(
            f"{path} is not marked complete ({MARKER}): a '.partial' folder is a save that "
            "did not finish; nothing was read"
        )


def load(
    spec: CompiledSpec,
    state: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    mesh: Any = None,
    partial: bool = False,
    locality: bool = True,
    storage_reader: Any = None,
    atomic: bool = True,
    verify: bool = True,
    trusted: bool = True,
) -> ShardspecLoadPlanner:
    """Load ``path`` into ``state`` in place. Validates everything before reading, reads
    into staging buffers, and changes the live tensors only after every rank's reads
    succeeded: a failed load leaves the model as it was.

    First, rank 0 finishes or undoes what an interrupted save of ``path`` left (see
    :func:`save`; reported as a :class:`CheckpointRecoveryWarning` and in the planner's
    ``recovered``). A folder that a shardspec save has not marked complete (the in-progress
    marker, or a ``.partial`` name) is refused; a DCP checkpoint without shardspec's marker
    (written by ``dcp.save``) loads.

    With ``locality`` (the default), a checkpoint saved on this very mesh with this very
    structure is read file-locally: each rank opens only the files it wrote, and replicas
    receive their copies from the writer (see :mod:`shardspec.runtime.checkpoint.locality`).

    ``atomic=False`` trades the guarantee for speed: after the same validation, DCP reads
    straight into the live tensors (no staging memory, no file locality), as fast as the
    planner alone. A read that fails then (a file truncated or removed after validation, an
    I/O error) leaves the tensors it had reached loaded and the others as they were.

    Every stored item is checked against the checksum ``save`` wrote for it
    (:mod:`shardspec.runtime.checkpoint.integrity`); a mismatch or a truncated file is a
    :class:`~shardspec.runtime.checkpoint.integrity.ChecksumError` naming the file, the key and the
    chunk, and the model is not changed. ``verify=False`` skips the checks. A checkpoint
    without checksums (written by ``dcp.save``) loads unverified.

    ``trusted=False`` loads a checkpoint you did not write within a trust boundary
    (:mod:`shardspec.runtime.checkpoint.trust`): ``.metadata`` through an allowlisting
    unpickler, and
    pickled entries checked by torch's ``weights_only`` unpickler before they are parsed.
    ``storage_reader`` replaces the reader (``verify`` and ``trusted`` then do nothing)."""
    path = os.fspath(path)
    wait_for_saves()
    recovered = _exchange(
        None,
        _outcome(_recover, path) if _rank0() else None,
        f"loading {path} failed while checking for an interrupted save",
    )
    _report(recovered)
    _refuse_unfinished(path)
    meta = os.path.join(path, ".metadata")
    if not os.path.isfile(meta):
        unfinished = _folder_state(path + ".partial") == "saving"
        more = f" ({path}.partial is an unfinished save)" if unfinished else ""
        raise CheckpointError(f"{meta} is missing: {path} is not a complete DCP checkpoint{more}")
    marker = _read_marker(path) if locality and atomic else None
    planner: ShardspecLoadPlanner
    if not atomic:
        planner = ShardspecLoadPlanner(spec, mesh, partial=partial, staging=False)
    elif marker is not None:
        from shardspec.runtime.checkpoint.locality import LocalityLoadPlanner

        planner = LocalityLoadPlanner(spec, mesh, marker=marker, partial=partial)
    else:
        planner = ShardspecLoadPlanner(spec, mesh, partial=partial, staging=True)
    reader = storage_reader if storage_reader is not None else _reader(path, verify, trusted)
    planner.capture = reader_fills_sinks(reader)
    error: CheckpointError | None = None
    try:
        with _no_gc():
            dcp.load(state, storage_reader=reader, planner=planner)
        exchange = getattr(planner, "exchange", None)
        if exchange is not None:
            exchange()
    except CheckpointError as e:  # ours, raised after DCP (the exchange): as it is
        _clear_frames(e)
        raise
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException: name it all
        state_of = "the model was not changed" if atomic else "the model may be partly loaded"
        error = _failure(e, f"reading {path} failed; {state_of}:\n{e}")
        if isinstance(error, ChecksumError):  # the reader's, which cannot tell atomic from not
            error = ChecksumError(f"{error}; {state_of}")
    if error is not None:  # raised here, out of the except clause: no context chained
        try:
            raise error
        finally:  # the traceback holds this frame: no cycle back through a local
            error = None
    planner.commit()
    planner.recovered = recovered
    return planner


def _reader(path: str, verify: bool, trusted: bool) -> Any:
    """``load``'s storage reader: DCP's ``FileSystemReader`` that verifies the checksums
    ``save`` stored (:class:`~shardspec.runtime.checkpoint.integrity.ChecksumReader`), within the
    trust boundary of :mod:`shardspec.runtime.checkpoint.trust` unless ``trusted``."""
    if trusted:
        return ChecksumReader(path, verify=verify)
    from shardspec.runtime.checkpoint.trust import SafeChecksumReader

    return SafeChecksumReader(path, verify=verify)


def _marker(spec: CompiledSpec, planner: ShardspecSavePlanner) -> dict[str, Any]:
    """The ``.shardspec.json`` of a complete checkpoint: the spec, the mesh, and the
    structure fingerprint a file-local load (:mod:`shardspec.runtime.checkpoint.locality`) compares
    with its own.

    Pipeline stages hold different structures, so no single fingerprint describes the
    checkpoint: the marker lists each stage's (``stage_fingerprints``) and records no
    ``fingerprint``. With rank 0's fingerprint (stage 0's) there, the first stage's ranks
    chose file-local reads and the others did not, and every load at pp > 1 on the mesh
    it was saved with failed ("ranks disagree on file locality"). Now no rank finds its
    fingerprint there, and every rank reads the checkpoint as on any other mesh."""
    marker: dict[str, Any] = {
        "format": "shardspec-checkpoint/1",
        "spec": spec.name,
        "mesh": dict(zip(planner.lmesh.names, planner.lmesh.sizes, strict=True)),
    }
    if planner.canon.stage is None:
        marker["fingerprint"] = planner.canon.fingerprint
    else:
        stages = getattr(planner, "stage_fingerprints", None) or {
            planner.canon.stage: planner.canon.fingerprint
        }
        marker["stage_fingerprints"] = {str(k): v for k, v in sorted(stages.items())}
    return marker


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """No cyclic garbage collection during a save or load: planning allocates many small
    objects, and a full collection on one rank (often the coordinator) stalls every rank."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _read_marker(path: str) -> dict | None:
    """The checkpoint's ``.shardspec.json``, or None (a default-planner checkpoint)."""
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


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
    error = CheckpointError(message)
    error.__cause__ = e
    return error


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
