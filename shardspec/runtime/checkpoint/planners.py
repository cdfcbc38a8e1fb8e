"""DCP planners that generated modules expose (``SavePlanner`` and ``LoadPlanner``
subclass these), and ``validate``, which compares a state dict with a checkpoint's metadata.

They replace every parameter-shaped entry of the state dict (parameters, and optimizer
states that follow them) by its canonical units (see :mod:`shardspec.runtime.canonical`);
everything else (scalars, param groups, other objects) goes through DCP's default handling.

* Writers are chosen statically, balanced by bytes: a replicated chunk is written once.
* Plans are cached under a fingerprint of the structure and the mesh, in a cache key of
  their own (per spec, planner role and fingerprint), so a new item, a dtype change or a
  new mesh re-plans, and model and optimizer planners never share a cache. DCP's plan
  cache is used only where it keeps new plans pending until the global plan succeeded
  (:func:`dcp_caches_pending_plans`).
* Loading validates the whole checkpoint before a byte is read and reports every missing,
  unexpected or mismatched key in one error. With ``staging``, chunks are read into
  staging buffers and reach the live tensors only in ``commit()``.
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
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
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

from shardspec.runtime.canonical import CanonicalPlan, Unit
from shardspec.runtime.checkpoint.global_plan import validate_global_plan
from shardspec.runtime.checkpoint.staging import _cpu_copy, _give, _Sink, _stage_value
from shardspec.runtime.spec import CompiledSpec
from shardspec.runtime.units import (
    KEY_LAYOUTS,
    CheckpointError,
    KeyLayout,
    _flat,
    canonical_plan,
    ignored_key,
    key_layout,
    mesh_and_rank,
    rename_path,
    unit_commit,
    unit_commit_box,
    unit_data,
)


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


# The cache key under which dcp_caches_pending_plans runs DCP's planner steps.
_PROBE_KEY = "shardspec:probe-dcp-plan-cache"


def _class_caches() -> list[dict]:
    """DCP's class-level plan caches (``SavePlanner._cached_*``)."""
    found = (getattr(SavePlanner, name) for name in dir(SavePlanner) if name.startswith("_cached_"))
    return [cache for cache in found if isinstance(cache, dict)]


@functools.lru_cache(maxsize=8)
def dcp_caches_pending_plans(planner_class: type = DefaultSavePlanner) -> bool:
    """Whether ``planner_class`` (DCP's ``DefaultSavePlanner`` by default) caches local
    plans the way :class:`ShardspecSavePlanner` relies on: ``create_local_plan`` keeps a
    new plan pending (the class-level cache ``SavePlanner._cached_save_plan`` unchanged,
    so a failed global plan leaves nothing stale), and ``finish_plan`` puts it in that
    cache. Found by running those two steps on a one-tensor state dict under a cache key
    of its own, removed again from every class-level cache. False for a DCP that stores
    the plan in ``create_local_plan`` already, or has no plan caching."""
    if not isinstance(getattr(SavePlanner, "_cached_save_plan", None), dict):
        return False
    try:
        planner = planner_class(enable_plan_caching=True)
    except TypeError:  # no plan caching at all
        return False
    planner._cached_plans_key = _PROBE_KEY
    try:
        planner.set_up_planner({"probe": torch.zeros(1)}, is_coordinator=True)
        plan = planner.create_local_plan()
        pending = _PROBE_KEY not in SavePlanner._cached_save_plan
        planner.finish_plan(plan)
        promoted = _PROBE_KEY in SavePlanner._cached_save_plan
    except Exception:  # another protocol altogether: never reuse a plan
        return False
    finally:
        for cache in _class_caches():
            cache.pop(_PROBE_KEY, None)
    return pending and promoted


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
        keys: str | KeyLayout | None = None,
    ) -> None:
        # Plan caching needs DCP's cache protocol (a class-level cache of local plans that
        # finish_plan fills from a pending plan, as in torch 2.13). Where the installed DCP
        # differs, plans are simply never reused: slower to plan, never stale.
        caching = enable_plan_caching and dcp_caches_pending_plans()
        try:
            super().__init__(enable_plan_caching=caching)
        except TypeError:  # a DCP without plan caching at all
            super().__init__()
            self._enable_plan_caching = False
        self.spec = spec
        self.role = role
        self.strict = strict
        self.keys = key_layout(keys, spec)
        self._mesh_arg = mesh
        self._staged: dict[str, torch.Tensor] | None = None
        self._pooled: list[torch.Tensor] = []
        self._set_up_done = False
        # Each pipeline stage's structure fingerprint (one entry, under None, without
        # stages): this rank's own once planned, every rank's once the coordinator compared.
        self.stage_fingerprints: dict[int | None, str] = {}
        self.recovered: list[str] = []  # what save() finished or undid of an interrupted save

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.is_coordinator = is_coordinator
        if self._set_up_done:  # stage() ran: planned and copied in the caller's thread
            self._set_up_done = False
            return
        self._set_up(state_dict)

    def _set_up(self, state_dict: Mapping[str, Any]) -> None:
        flat, mappings = _flat(state_dict)
        self.lmesh, self.rank = mesh_and_rank(self.spec, self._mesh_arg)
        self.canon, rest, self.local = canonical_plan(
            self.spec, self.lmesh, self.rank, flat, keys=self.keys, stored=True
        )
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

            cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)
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
        keys: str | KeyLayout | None = None,
    ) -> None:
        super().__init__(allow_partial_load=partial)
        self.recovered: list[str] = []  # what load() finished or undid of an interrupted save
        self.spec = spec
        self.keys = key_layout(keys, spec)
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
            self.spec, self.lmesh, self.rank, flat, saving=False, keys=self.keys, stored=True
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
                # validate() found a tensor's metadata under every unit's key
                meta = cast(TensorStorageMetadata, md[unit.key])
                items.extend(create_read_items_for_chunk_list(unit.key, meta, [chunk]))
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
        md = cast(TensorStorageMetadata, self.metadata.state_dict_metadata[source])  # see _legacy
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
            "nothing was read:\n  " + "\n  ".join(problems) + _key_layout_hint(canon, md)
        )
    return legacy, skipped


def _key_layout_hint(canon: CanonicalPlan, md: Mapping[str, Any]) -> str:
    """Where the checkpoint holds a parameter's components under the keys another
    trainer's hooks write (torchtitan's ``qkv_linear.wq.weight``) and the state dict asks
    for them in shardspec's own layout: which ``keys=`` reads it."""
    missing = {
        u.source
        for u in canon.units
        if u.key not in md and (u.fused is not None or u.squeeze is not None)
    }
    for name, layout in KEY_LAYOUTS.items():
        found = next((k for k in md for s in layout.sources(k) if s in missing), None)
        if found is not None:
            return f"\nhint: the checkpoint stores {found} as {name} does; load with keys={name!r}"
    return ""


def _mentions(key: str, names: frozenset[str]) -> bool:
    """Whether a dot-bounded part of flat key ``key`` is one of ``names``, or a component
    (``<name>.<component>``) of one."""
    parts = key.split(".")
    for i in range(len(parts)):
        for j in range(i + 1, len(parts) + 1):
            if ".".join(parts[i:j]) in names:
                return True
    return False


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
