"""The canonical-plan cache (``shardspec.runtime.checkpoint.canonical_plan``) and the
per-layout chunk tables behind the static writer choice: a cached plan is reused only for
the very same structure, binds the caller's current tensors, and equals a fresh build.
And DCP's own plan cache: the save planner uses it only where DCP keeps a new local plan
pending until the global plan succeeded (``planners.dcp_caches_pending_plans``)."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from bench import bench_checkpoint as bc
from shardspec.runtime import checkpoint as ck
from shardspec.runtime import units
from shardspec.runtime.canonical import assign_writers, rank_pieces, replica_groups
from shardspec.runtime.checkpoint import planners

SPEC = bc.bench_spec({})  # generated.llama's spec, tiny model


def _sim(world: int = 8, tp: int = 2) -> bc._Sim:
    return bc._Sim(SPEC, world, tp, None)


def _state(sim: bc._Sim, dtype: torch.dtype = torch.float32) -> dict[str, object]:
    """A fresh model state (meta tensors: only structure matters) with a step counter."""
    model = {k: torch.empty(v.shape, dtype=dtype, device="meta") for k, v in sim.state.items()}
    return {"model": model, "extra": {"step": torch.tensor(3), "name": "run-1"}}


def _plan(sim: bc._Sim, state: dict, rank: int = 1, saving: bool = True):
    flat, _ = units._flat(state)
    return ck.canonical_plan(SPEC, sim.lm, rank, flat, saving=saving)


def test_same_structure_reuses_the_plan_and_binds_new_tensors() -> None:
    ck.clear_plan_cache()
    sim = _sim()
    first, second = _state(sim), _state(sim)
    p1, _, local1 = _plan(sim, first)
    p2, rest2, local2 = _plan(sim, second)
    assert p2 is p1
    flat2, _ = units._flat(second)
    for _key, (unit, tensor) in local2.items():
        assert tensor is flat2[unit.source]
    assert rest2["extra.step"] is second["extra"]["step"]
    assert rest2["extra.name"] == "run-1"
    assert set(local1) == set(local2)


def test_cache_cannot_go_stale() -> None:
    ck.clear_plan_cache()
    sim = _sim()
    base, _, _ = _plan(sim, _state(sim))
    # A new key re-plans and is stored.
    more = _state(sim)
    more["extra"]["x"] = torch.zeros(4)
    p, rest, _ = _plan(sim, more)
    assert p is not base and "extra.x" in rest and p.fingerprint != base.fingerprint
    # A dtype change re-plans (units' item sizes and dtypes follow).
    half, _, local = _plan(sim, _state(sim, torch.bfloat16))
    assert half is not base and half.fingerprint != base.fingerprint
    assert {u.itemsize for u in half.units} == {2}
    assert set(half.dtypes.values()) == {torch.bfloat16}
    assert all(t.dtype == torch.bfloat16 for _, t in local.values())
    # A shape change of a non-parameter entry re-plans.
    other = _state(sim)
    other["extra"]["step"] = torch.zeros(2)
    assert _plan(sim, other)[0] is not base
    # A new mesh re-plans (other chunks, other fingerprint).
    sim1 = _sim(tp=1)
    p1, _, _ = _plan(sim1, _state(sim1))
    assert p1 is not base and p1.fingerprint != base.fingerprint
    # Another rank, or loading instead of saving, is another plan.
    assert _plan(sim, _state(sim), rank=2)[0] is not base
    assert _plan(sim, _state(sim), saving=False)[0] is not base
    # And the original structure is still the original plan.
    assert _plan(sim, _state(sim))[0] is base


def test_cached_plan_equals_a_fresh_build() -> None:
    sim = _sim()
    ck.clear_plan_cache()
    cached, _, _ = _plan(sim, _state(sim))
    _plan(sim, _state(sim))  # a hit
    ck.clear_plan_cache()
    fresh, _, _ = _plan(sim, _state(sim))
    assert fresh is not cached
    assert fresh.units == cached.units
    assert fresh.writer == cached.writer
    assert fresh.keys == cached.keys
    assert fresh.fingerprint == cached.fingerprint


def test_cache_is_bounded_and_holds_specs_weakly() -> None:
    ck.clear_plan_cache()
    sim = _sim()
    for n in range(units.PLAN_CACHE_SIZE + 3):
        state = _state(sim)
        state["extra"][f"k{n}"] = torch.zeros(1)
        _plan(sim, state)
    assert len(units._PLANS[SPEC]) == units.PLAN_CACHE_SIZE
    spec = bc.bench_spec({})
    flat, _ = units._flat(_state(sim))
    ck.canonical_plan(spec, sim.lm, 0, flat)
    assert spec in units._PLANS
    del spec
    gc.collect()
    assert len(units._PLANS) == 1  # only SPEC's


def _reference_writers(sim: bc._Sim, state: dict) -> dict:
    """The writer choice computed the direct way: every rank's every piece of every
    parameter (O(world) per parameter), deduplicated by assign_writers itself. Returns
    ``(key, offsets) -> (writer, replicas)`` for every chunk."""
    flat, _ = units._flat(state)
    chunks = []
    for key in sorted(flat):
        if not key.startswith("model."):
            continue
        layout = SPEC.layout(key.removeprefix("model."), sim.lm)
        groups = replica_groups(layout, sim.lm)
        itemsize = flat[key].element_size()
        for r, row in enumerate(rank_pieces(layout, sim.lm)):
            for k, piece in enumerate(row):
                if any(s == 0 for s in piece.sizes):
                    continue
                name = key if piece.component is None else f"{key}.{piece.component}"
                nbytes = math.prod(piece.sizes) * itemsize
                chunks.append(((name, piece.offsets), groups[r][k], nbytes))
    writers = assign_writers(chunks, sim.lm.world)
    return {ident: (writers[ident], replicas) for ident, replicas, _ in chunks}


def test_layout_tables_choose_the_same_writers_as_every_rank_loop() -> None:
    for world, tp in ((8, 2), (16, 2), (6, 2), (4, 1)):
        sim = _sim(world, tp)
        state = _state(sim)
        ck.clear_plan_cache()
        plan, _, _ = _plan(sim, state, rank=0)
        ref = _reference_writers(sim, state)
        assert (tp > 1) == any(len(replicas) > 1 for _, replicas in ref.values())
        got = {
            ident: (plan.writer_of(*ident, replicas), replicas)
            for ident, (_, replicas) in ref.items()
        }
        assert got == ref, (world, tp)
        # Every rank computes the same map.
        for rank in range(1, world):
            assert _plan(sim, state, rank=rank)[0].writer == plan.writer


def test_assign_writers_balances_bytes_lowest_rank_on_ties() -> None:
    chunks = [
        (("a", (0,)), (0, 1), 10),
        (("b", (0,)), (0, 1), 10),
        (("c", (0,)), (1, 2), 5),
        (("d", (0,)), (2,), 7),
        (("a", (0,)), (0, 1), 10),  # a duplicate: counted once
    ]
    out = assign_writers(chunks, 3)
    assert out == {("d", (0,)): 2, ("a", (0,)): 0, ("b", (0,)): 1, ("c", (0,)): 2}
    assert assign_writers([(("x", (0,)), (2, 1, 0), 4)], 3) == {("x", (0,)): 0}


# ----------------------------------------------------------------------------- DCP's cache


class _StoresAtOnce(DefaultSavePlanner):
    """DCP's earlier plan cache (torch 2.11): ``create_local_plan`` stores a new local plan
    in the class-level cache at once (stale if the global plan then fails)."""

    def create_local_plan(self) -> SavePlan:
        self.plan = create_default_local_save_plan(self.state_dict, self.is_coordinator)
        if self._enable_plan_caching:
            SavePlanner._cached_save_plan[self._cached_plans_key] = self.plan
        return self.plan

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan


class _KeepsPending(DefaultSavePlanner):
    """DCP's later plan cache (torch 2.13): the new plan is pending until ``finish_plan``."""

    def create_local_plan(self) -> SavePlan:
        self.plan = create_default_local_save_plan(self.state_dict, self.is_coordinator)
        if self._enable_plan_caching:
            self._pending_local_plan = self.plan
        return self.plan

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if self._enable_plan_caching and hasattr(self, "_pending_local_plan"):
            SavePlanner._cached_save_plan[self._cached_plans_key] = self._pending_local_plan
            del self._pending_local_plan
        self.plan = new_plan
        return new_plan


class _NoCaching(DefaultSavePlanner):
    """A DCP without plan caching: no ``enable_plan_caching`` argument."""

    def __init__(self) -> None:
        super().__init__()


def _probe_keys() -> list[str]:
    return [k for cache in planners._class_caches() for k in cache if "probe" in k]


@pytest.mark.parametrize(
    ("planner_class", "promotes"),
    [(_KeepsPending, True), (_StoresAtOnce, False), (_NoCaching, False)],
)
def test_the_dcp_cache_probe_tells_the_protocols_apart(planner_class: type, promotes: bool) -> None:
    assert planners.dcp_caches_pending_plans(planner_class) is promotes
    assert _probe_keys() == []  # the probe leaves no plan in DCP's caches


class _FailsGlobally(DefaultSavePlanner):
    def create_global_plan(self, all_plans: list[SavePlan]):
        raise ValueError("refused by the test")


class _Recording(ck.ShardspecSavePlanner):
    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self.cache_hit = not plan.usable
        return plan


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_probe_agrees_with_the_installed_dcp(tmp_path) -> None:
    """What ``dcp.save`` itself does with a local plan (kept out of the class-level cache
    when the global plan fails, put there when the save succeeds) is what the probe says;
    and the save planner reuses its plan exactly then."""
    import torch.distributed.checkpoint as dcp

    state = {"x": torch.zeros(3)}
    key = f"shardspec:test-probe:{tmp_path.name}"
    failing = _FailsGlobally(enable_plan_caching=True)
    failing._cached_plans_key = key
    with pytest.raises((CheckpointException, ValueError)):
        dcp.save(state, checkpoint_id=str(tmp_path / "failed"), planner=failing)
    kept_out = key not in SavePlanner._cached_save_plan
    saving = DefaultSavePlanner(enable_plan_caching=True)
    saving._cached_plans_key = key
    dcp.save(state, checkpoint_id=str(tmp_path / "saved"), planner=saving)
    put_in = key in SavePlanner._cached_save_plan
    for cache in planners._class_caches():
        cache.pop(key, None)
    promotes = planners.dcp_caches_pending_plans()
    assert promotes == (kept_out and put_in)

    mesh = bc._Sim(SPEC, 1, 1, None).mesh(0)
    gen = torch.Generator().manual_seed(0)
    model = {k: torch.randn(p.shape, generator=gen) for k, p in SPEC.params.items()}
    hits = []
    for n in range(2):
        planner = _Recording(SPEC, mesh, role=f"test-probe-{tmp_path.name}")
        ck.save(SPEC, {"model": model}, str(tmp_path / f"c{n}"), mesh=mesh, planner=planner)
        hits.append(planner.cache_hit)
    assert hits == [False, promotes]
