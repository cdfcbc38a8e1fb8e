"""Multi-rank scenarios for ``tests/test_checkpoint_faults.py``: plan caching, validation,
empty shards, bad checkpoints and failed saves, on gloo CPU ranks.

Each scenario appends failure strings instead of raising (so no rank is left waiting in a
collective) and counts what it checked; :func:`run_all` runs them all in one spawn.
"""

from __future__ import annotations

import os
import shutil
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor

from examples.models import llama, moe
from shardspec.runtime import CompiledSpec, RuleSpec
from shardspec.runtime import checkpoint as ck
from shardspec.runtime.dtensor import distribute

Failures = list[str]
CHECKED: dict[str, int] = {}


def _count(tag: str, n: int = 1) -> None:
    CHECKED[tag] = CHECKED.get(tag, 0) + n


def _llama(mod: Any, mesh: Any, seed: int) -> nn.Module:
    model = llama.tiny()
    llama.init_weights(model, seed)
    mod.distribute(model, mesh)
    return model


def _locals(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


def _expect_error(fn: Callable[[], Any], *needles: str) -> str | None:
    """Run ``fn``; return None if it raised CheckpointError containing every needle."""
    try:
        fn()
    except ck.CheckpointError as e:
        missing = [n for n in needles if n not in str(e)]
        return f"error lacks {missing}: {e}" if missing else None
    except Exception as e:
        return f"expected CheckpointError, got {type(e).__name__}: {e}"
    return "no error raised"


class _Recording(ck.ShardspecSavePlanner):
    """Records whether its local plan came from the cache."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        self.cache_hit = not plan.usable
        return plan


# ----------------------------------------------------------------------------- caching


def plan_caching(mod: Any, mesh: Any, rank: int, root: str, fail: Failures) -> None:
    tag = "[caching]"
    model = _llama(mod, mesh, 1)
    msd = model.state_dict()
    # Save 1 without X, save 2 with X (state that only a later save has): X must be there.
    p1 = ck.save(mod.SPEC, {"model": msd}, f"{root}/c1", mesh=mesh)
    x = torch.arange(6.0) + rank * 0  # same on every rank
    p2 = ck.save(mod.SPEC, {"model": msd, "fault": {"x": x}}, f"{root}/c2", mesh=mesh)
    if p1._cached_plans_key == p2._cached_plans_key:
        fail.append(f"{tag} adding an item kept the cache key {p1._cached_plans_key}")
    target = {"model": _llama(mod, mesh, 2).state_dict(), "fault": {"x": torch.zeros(6)}}
    ck.load(mod.SPEC, target, f"{root}/c2", mesh=mesh)
    if not torch.equal(target["fault"]["x"], x):
        fail.append(f"{tag} item added on the second save came back as {target['fault']['x']}")
    # Every stored key has its object path, so DCP's own tools can rebuild the nesting.
    meta = dcp.FileSystemReader(f"{root}/c2").read_metadata()
    no_path = sorted(k for k in meta.state_dict_metadata if k not in meta.planner_data)
    if no_path:
        fail.append(f"{tag} keys without planner_data paths: {no_path[:4]}")
    elif meta.planner_data["model.norm.weight"] != ("model", "norm.weight"):
        fail.append(f"{tag} model.norm.weight path {meta.planner_data['model.norm.weight']}")
    _count(tag)
    # The same structure again: a cache hit, and still a correct checkpoint.
    again = _Recording(mod.SPEC, mesh)
    ck.save(mod.SPEC, {"model": msd, "fault": {"x": x}}, f"{root}/c3", mesh=mesh, planner=again)
    if not again.cache_hit:
        fail.append(f"{tag} an unchanged structure did not reuse the cached plan")
    fresh = _llama(mod, mesh, 3)
    ck.load(
        mod.SPEC,
        {"model": fresh.state_dict(), "fault": {"x": torch.zeros(6)}},
        f"{root}/c3",
        mesh=mesh,
    )
    bad = _same(_locals(model), _locals(fresh))
    if bad:
        fail.append(f"{tag} checkpoint saved from a cached plan differs: {bad[:3]}")
    _count(tag)
    # A dtype change re-plans (DCP's own plan comparison ignores dtypes).
    half = {k: v.to(torch.bfloat16) for k, v in msd.items()}
    p4 = _Recording(mod.SPEC, mesh)
    ck.save(mod.SPEC, {"model": half, "fault": {"x": x}}, f"{root}/c4", mesh=mesh, planner=p4)
    if p4.cache_hit or p4._cached_plans_key == again._cached_plans_key:
        fail.append(f"{tag} a dtype change did not re-plan")
    md = dcp.FileSystemReader(f"{root}/c4").read_metadata().state_dict_metadata
    if md["model.norm.weight"].properties.dtype != torch.bfloat16:
        fail.append(f"{tag} bf16 save stored {md['model.norm.weight'].properties.dtype}")
    _count(tag)
    # Model and optimizer planners never share a cache, even with one structure.
    a = ck.ShardspecSavePlanner(mod.SPEC, mesh, role="model")
    b = ck.ShardspecSavePlanner(mod.SPEC, mesh, role="optim")
    for p in (a, b):
        p.set_up_planner({"model": msd})
    if a._cached_plans_key == b._cached_plans_key:
        fail.append(f"{tag} model and optimizer planners share cache key {a._cached_plans_key}")
    # A new mesh re-plans.
    other = mod.build_mesh(tp=1)
    c = ck.ShardspecSavePlanner(mod.SPEC, other)
    c.set_up_planner({"model": _llama(mod, other, 1).state_dict()})
    if c._cached_plans_key == a._cached_plans_key.replace(":model:", ":state:"):
        fail.append(f"{tag} a different mesh kept the cache key")
    if c.canon.fingerprint == a.canon.fingerprint:
        fail.append(f"{tag} a different mesh kept the fingerprint")
    _count(tag)


# ----------------------------------------------------------------------------- validation


def validation(mod: Any, mesh: Any, rank: int, root: str, fail: Failures) -> None:
    tag = "[validation]"
    model = _llama(mod, mesh, 1)
    msd = model.state_dict()
    extra = {"a": torch.arange(5.0), "b": torch.ones(2)}
    ck.save(mod.SPEC, {"model": msd, "extra": extra}, f"{root}/v", mesh=mesh)
    target_model = _llama(mod, mesh, 9)
    before = _locals(target_model)
    tsd = target_model.state_dict()
    dropped = "layers.1.ffn_norm.weight"
    tsd.pop(dropped)
    target = {"model": tsd, "extra": {"a": torch.zeros(4), "c": torch.zeros(1)}}
    err = _expect_error(
        lambda: ck.load(mod.SPEC, target, f"{root}/v", mesh=mesh),
        f"unexpected: model.{dropped}",
        "unexpected: extra.b",
        "extra.a: shape [5] in the checkpoint, [4]",
        "missing: extra.c",
        "4 problem(s)",
    )
    if err:
        fail.append(f"{tag} mismatches: {err}")
    if _same(before, _locals(target_model)):
        fail.append(f"{tag} a rejected load changed the model")
    _count(tag)
    # dtype: every parameter chunk is named.
    half = {k: v.to(torch.bfloat16) for k, v in _llama(mod, mesh, 9).state_dict().items()}
    err = _expect_error(
        lambda: ck.load(mod.SPEC, {"model": half, "extra": extra}, f"{root}/v", mesh=mesh),
        "model.norm.weight: dtype torch.float32 in the checkpoint, torch.bfloat16",
        "model.layers.0.feed_forward.w13.weight.gate: dtype",
    )
    if err:
        fail.append(f"{tag} dtype: {err}")
    _count(tag)
    # A partial load only when asked: a checkpoint of some parameters.
    some = {k: v for k, v in msd.items() if k.startswith("layers.0.")}
    ck.save(mod.SPEC, {"model": some}, f"{root}/some", mesh=mesh)
    fresh = _llama(mod, mesh, 5)
    err = _expect_error(
        lambda: ck.load(mod.SPEC, {"model": fresh.state_dict()}, f"{root}/some", mesh=mesh),
        "missing: model.norm.weight",
        "missing: model.layers.1.feed_forward.w13.weight.up",
    )
    if err:
        fail.append(f"{tag} strict load of a partial checkpoint: {err}")
    kept = _locals(fresh)
    planner = ck.load(
        mod.SPEC, {"model": fresh.state_dict()}, f"{root}/some", mesh=mesh, partial=True
    )
    now = _locals(fresh)
    orig = _locals(model)
    for k in now:
        want = orig[k] if k.startswith("layers.0.") else kept[k]
        if not torch.equal(now[k], want):
            fail.append(f"{tag} partial load: {k} is wrong")
    if "model.norm.weight" not in planner.skipped:
        fail.append(f"{tag} partial load did not report skipped keys: {planner.skipped[:5]}")
    _count(tag)
    # A checkpoint of another model: every difference named, nothing read.
    mmesh = _moe_mesh()
    m = moe.tiny()
    moe.init_weights(m, 0)
    import generated.deepseek_moe as mo

    mo.distribute(m, mmesh)
    err = _expect_error(
        lambda: ck.load(mo.SPEC, {"model": m.state_dict()}, f"{root}/v", mesh=mmesh),
        "missing: model.embed.weight",
        "unexpected: model.tok_embeddings.weight",
    )
    if err:
        fail.append(f"{tag} different model: {err}")
    _count(tag)


def _moe_mesh():
    import generated.deepseek_moe as mo

    return mo.build_mesh(ep=2)


def ignored_entries(root: str, rank: int, fail: Failures) -> None:
    """``ignore **._extra_state``: never saved by shardspec, and not unexpected when a
    default-planner checkpoint has it."""
    tag = "[ignore]"
    import generated.deepseek_moe as mo

    mesh = _moe_mesh()
    m = moe.tiny()
    moe.init_weights(m, 0)
    mo.distribute(m, mesh)
    sd = m.state_dict()
    if not any("_extra_state" in k for k in sd):
        fail.append(f"{tag} the model has no extra state to test with")
    ck.save(mo.SPEC, {"model": sd}, f"{root}/i1", mesh=mesh)
    md = dcp.FileSystemReader(f"{root}/i1").read_metadata().state_dict_metadata
    leaked = [k for k in md if "_extra_state" in k]
    if leaked:
        fail.append(f"{tag} ignored entries were saved: {leaked}")
    dcp.save({"model": sd}, checkpoint_id=f"{root}/i2")
    md = dcp.FileSystemReader(f"{root}/i2").read_metadata().state_dict_metadata
    if not any("_extra_state" in k for k in md):
        fail.append(f"{tag} the default planner did not save extra state (test premise)")
    m2 = moe.tiny()
    moe.init_weights(m2, 7)
    mo.distribute(m2, mesh)
    try:
        ck.load(mo.SPEC, {"model": m2.state_dict()}, f"{root}/i2", mesh=mesh)
    except Exception as e:
        fail.append(f"{tag} a default-planner checkpoint with extra state failed: {e}")
    bad = _same(_locals(m), _locals(m2))
    if bad:
        fail.append(f"{tag} default-planner checkpoint loaded wrong values: {bad[:3]}")
    _count(tag)


# ----------------------------------------------------------------------------- bad files


def bad_checkpoints(mod: Any, mesh: Any, rank: int, root: str, fail: Failures) -> None:
    tag = "[bad-files]"
    model = _llama(mod, mesh, 1)
    ck.save(mod.SPEC, {"model": model.state_dict()}, f"{root}/b", mesh=mesh)
    dist.barrier()
    # No .metadata.
    if rank == 0:
        shutil.copytree(f"{root}/b", f"{root}/nometa")
        os.remove(f"{root}/nometa/.metadata")
    dist.barrier()
    target = _llama(mod, mesh, 4)
    before = _locals(target)
    err = _expect_error(
        lambda: ck.load(mod.SPEC, {"model": target.state_dict()}, f"{root}/nometa", mesh=mesh),
        f"{root}/nometa/.metadata is missing",
    )
    if err:
        fail.append(f"{tag} missing .metadata: {err}")
    _count(tag)
    # A truncated data file: an error naming the checkpoint, and no rank's model changed.
    if rank == 0:
        shutil.copytree(f"{root}/b", f"{root}/trunc")
        victim = f"{root}/trunc/__1_0.distcp"
        size = os.path.getsize(victim)
        with open(victim, "r+b") as f:
            f.truncate(size // 2)
    dist.barrier()
    err = _expect_error(
        lambda: ck.load(mod.SPEC, {"model": target.state_dict()}, f"{root}/trunc", mesh=mesh),
        f"{root}/trunc",
        "the model was not changed",
    )
    if err:
        fail.append(f"{tag} truncated file: {err}")
    if _same(before, _locals(target)):
        fail.append(f"{tag} a failed load changed the model on rank {rank}")
    _count(tag)
    # atomic=False: straight into the live tensors. A good checkpoint loads bitwise; a
    # failed read says the model may be partly loaded.
    ck.load(mod.SPEC, {"model": target.state_dict()}, f"{root}/b", mesh=mesh, atomic=False)
    diff = _same(_locals(model), _locals(target))
    if diff:
        fail.append(f"{tag} atomic=False load differs from the saved model: {diff[:3]}")
    _count(tag)
    err = _expect_error(
        lambda: ck.load(
            mod.SPEC, {"model": target.state_dict()}, f"{root}/trunc", mesh=mesh, atomic=False
        ),
        f"{root}/trunc",
        "the model may be partly loaded",
    )
    if err:
        fail.append(f"{tag} truncated file, atomic=False: {err}")
    _count(tag)


def failed_save(mod: Any, mesh: Any, rank: int, root: str, fail: Failures) -> None:
    """One rank fails while writing: the previous checkpoint stays intact and loadable, and
    the new one is not marked complete."""
    tag = "[failed-save]"
    model = _llama(mod, mesh, 1)
    first = _locals(model)
    path = f"{root}/fs"
    ck.save(mod.SPEC, {"model": model.state_dict()}, path, mesh=mesh)
    before = sorted(os.listdir(path))
    changed = _llama(mod, mesh, 2)

    class Failing(ck.ShardspecSavePlanner):
        def resolve_data(self, write_item):
            if self.rank == 1:
                raise OSError("simulated: no space left on device")
            return super().resolve_data(write_item)

    err = _expect_error(
        lambda: ck.save(
            mod.SPEC,
            {"model": changed.state_dict()},
            path,
            mesh=mesh,
            planner=Failing(mod.SPEC, mesh),
        ),
        f"saving {path} failed on rank(s) [1]",
        "no space left on device",
        "the unfinished save in",
    )
    if err:
        fail.append(f"{tag} on rank {rank}: {err}")
    dist.barrier()
    if sorted(os.listdir(path)) != before:
        fail.append(f"{tag} the previous checkpoint's files changed")
    if os.path.exists(os.path.join(path + ".partial", ck.MARKER)):
        fail.append(f"{tag} the failed save was marked complete")
    target = _llama(mod, mesh, 3)
    ck.load(mod.SPEC, {"model": target.state_dict()}, path, mesh=mesh)
    bad = _same(first, _locals(target))
    if bad:
        fail.append(f"{tag} the previous checkpoint no longer loads its values: {bad[:3]}")
    err = _expect_error(
        lambda: ck.load(mod.SPEC, {"model": target.state_dict()}, path + ".missing", mesh=mesh),
        ".metadata is missing",
    )
    if err:
        fail.append(f"{tag} {err}")
    # Ranks whose state dicts differ in structure would choose writers differently (some
    # chunks written by nobody): refused on every rank, nothing saved.
    odd = {"model": model.state_dict()}
    if rank == 1:
        odd["extra"] = {"only_here": torch.zeros(3)}
    err = _expect_error(
        lambda: ck.save(mod.SPEC, odd, f"{root}/odd", mesh=mesh),
        "ranks disagree on the checkpoint's structure",
    )
    if err:
        fail.append(f"{tag} mismatched structures: {err}")
    if os.path.exists(f"{root}/odd"):
        fail.append(f"{tag} a refused save created {root}/odd")
    _count(tag)
    # A folder named <path>.partial that no shardspec save started (no in-progress marker)
    # is never deleted: the save is refused. An unmarked '.partial' folder is never loaded,
    # even one holding every file of a checkpoint but the completion marker.
    mine, unmarked = f"{root}/mine", f"{root}/plain.partial"
    if rank == 0:
        os.makedirs(mine + ".partial")
        with open(f"{mine}.partial/notes.txt", "w") as f:
            f.write("the user's own")
        shutil.copytree(path, unmarked)
        os.remove(os.path.join(unmarked, ck.MARKER))
    dist.barrier()
    err = _expect_error(
        lambda: ck.save(mod.SPEC, {"model": model.state_dict()}, mine, mesh=mesh),
        f"{mine}.partial exists and is not a save in progress",
        "nothing was saved",
    )
    if err:
        fail.append(f"{tag} someone else's .partial folder: {err}")
    if not os.path.isfile(f"{mine}.partial/notes.txt") or os.path.exists(mine):
        fail.append(f"{tag} a save touched someone else's {mine}.partial")
    err = _expect_error(
        lambda: ck.load(mod.SPEC, {"model": target.state_dict()}, unmarked, mesh=mesh),
        "is not marked complete",
        "nothing was read",
    )
    if err:
        fail.append(f"{tag} an unmarked .partial folder: {err}")
    _count(tag)


# ----------------------------------------------------------------------------- empty shards


class _Uneven(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(12.0).reshape(3, 4))
        self.v = nn.Parameter(torch.arange(5.0))


def empty_shards(mesh1d: Any, rank: int, root: str, fail: Failures) -> None:
    """Rank 3 owns 0 rows of ``w`` (3 rows over 4 ranks): it writes nothing for it, no rank
    materializes the full tensor, and the round trip is exact."""
    tag = "[empty]"
    spec = CompiledSpec(
        name="uneven",
        axes=("dp",),
        sizes={"dp": None},
        world=None,
        rules=(
            RuleSpec(pattern="w", dims=("rows", "cols"), shard=(("rows", ("dp",)),)),
            RuleSpec(pattern="v", dims=("n",), shard=(("n", ("dp",)),)),
        ),
        params=None,
    )
    model = _Uneven()
    distribute(spec, model, mesh1d)
    if rank == 3 and model.w.to_local().numel() != 0:
        fail.append(f"{tag} rank 3 holds {model.w.to_local().shape} of w, expected nothing")
    planner = ck.save(spec, {"m": model.state_dict()}, f"{root}/e", mesh=mesh1d)
    units = [u for u in planner.canon.units if u.key == "m.w"]
    if rank == 3 and (len(units) != 1 or not units[0].empty):
        fail.append(f"{tag} rank 3's unit of w is {units}")
    if any(u.sizes == u.shape for u in planner.canon.units if u.key == "m.w"):
        fail.append(f"{tag} rank {rank} cut the full w")
    fresh = _Uneven()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    distribute(spec, fresh, mesh1d)
    ck.load(spec, {"m": fresh.state_dict()}, f"{root}/e", mesh=mesh1d)
    for name in ("w", "v"):
        got = getattr(fresh, name).full_tensor()
        want = getattr(_Uneven(), name).detach()
        if not torch.equal(got, want):
            fail.append(f"{tag} {name} came back as {got}")
    _count(tag)


# ----------------------------------------------------------------------------- placements


class _Replicated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Parameter(torch.arange(48.0).reshape(8, 6))
        # fused rows [gate; up], 4 + 4, replicated over tp at run time
        self.f = nn.Parameter(100.0 + torch.arange(48.0).reshape(8, 6))


def checkpoint_placement(rank: int, root: str, fail: Failures) -> None:
    """``checkpoint shard cols over tp`` on a parameter sharded over dp and replicated over
    tp: each rank stores its own distinct piece (no replicated chunk among writers, equal
    bytes), and the checkpoint reshards exactly onto another mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    tag = "[ckpt-placement]"
    rule = RuleSpec(
        pattern="e",
        dims=("rows", "cols"),
        shard=(("rows", ("dp",)),),
        ckpt_shard=(("cols", ("tp",)),),
    )
    # A checkpoint split on a fused dimension: tp 0 stores gate, tp 1 stores up.
    fused = RuleSpec(
        pattern="f",
        dims=("ffn", "hidden"),
        shard=(("hidden", ("dp",)),),
        fuse=(("ffn", (("gate", None), ("up", None)), 1),),
        ckpt_shard=(("ffn", ("tp",)),),
    )
    spec = CompiledSpec(
        name="ckpt_split",
        axes=("dp", "tp"),
        sizes={"dp": None, "tp": 2},
        world=None,
        rules=(rule, fused),
        params=None,
    )
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _Replicated()
    distribute(spec, model, mesh)
    planner = ck.save(spec, {"m": model.state_dict()}, f"{root}/cp", mesh=mesh)
    unit, *components = planner.canon.units
    tp_rank = mesh.get_coordinate()[1]
    stored = {u.key.rsplit(".", 1)[1]: u.sizes for u in components}
    want = {"gate": (4, 3), "up": (0, 3)} if tp_rank == 0 else {"gate": (0, 3), "up": (4, 3)}
    if stored != want:
        fail.append(f"{tag} fused f: tp rank {tp_rank} stores {stored}, expected {want}")
    if unit.sizes != (4, 3) or len(unit.replicas) != 1:
        fail.append(f"{tag} stored {unit.sizes} with replicas {unit.replicas}")
    if planner.canon.writer_of(unit.key, unit.offsets, unit.replicas) != rank:
        fail.append(f"{tag} another rank writes this rank's piece")
    counts = [0] * dist.get_world_size()
    dist.all_gather_object(counts, planner.bytes_written())
    if counts != [96] * 4:
        fail.append(f"{tag} bytes written per rank: {counts}")
    chunks = dcp.FileSystemReader(f"{root}/cp").read_metadata().state_dict_metadata["m.e"].chunks
    if len(chunks) != 4:
        fail.append(f"{tag} the checkpoint has {len(chunks)} chunks of m.e, expected 4")
    other = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    target = _Replicated()
    with torch.no_grad():
        target.e.zero_()
        target.f.zero_()
    distribute(spec, target, other)
    ck.load(spec, {"m": target.state_dict()}, f"{root}/cp", mesh=other)
    if not torch.equal(target.e.full_tensor(), torch.arange(48.0).reshape(8, 6)):
        fail.append(f"{tag} reshard after a checkpoint split: {target.e.full_tensor()}")
    if not torch.equal(target.f.full_tensor(), 100.0 + torch.arange(48.0).reshape(8, 6)):
        fail.append(f"{tag} reshard after a split of fused rows: {target.f.full_tensor()}")
    _count(tag)


# ----------------------------------------------------------------------------- local experts


def local_experts_resized(rank: int, root: str, fail: Failures) -> None:
    """Megatron-style per-EP-rank expert modules saved at ep=4 load at (ep 2 x dp_shard 2):
    experts are stored under global indices, so each EP rank gets its own experts back.
    The manifest was built for ep=2, so at ep=4 the runtime matches rules against the
    model's own tensors instead of the manifest's table."""
    import generated.deepseek_moe_local as ml

    tag = "[local-experts-ep]"
    ref = moe.tiny()
    moe.init_weights(ref, 11)
    full = {k: v for k, v in ref.state_dict().items() if "_extra_state" not in k}
    cfg = ref.config

    def built(mesh: Any, ep: int, seed: int | None) -> nn.Module:
        ep_rank = mesh.get_coordinate()[mesh.mesh_dim_names.index("ep")]
        model = moe.tiny_local(ep=ep)
        if seed is None:
            model.load_state_dict(moe.local_expert_state(full, ep_rank, ep, cfg), strict=False)
        else:
            moe.init_weights(model, seed)
        ml.distribute(model, mesh)
        return model

    mesh4 = ml.build_mesh(ep=4)
    if ml.SPEC.table(mesh4) is not None:
        fail.append(f"{tag} the ep=2 manifest table was used at ep=4")
    source = built(mesh4, 4, None)
    ck.save(ml.SPEC, {"model": source.state_dict()}, f"{root}/le", mesh=mesh4)
    md = dcp.FileSystemReader(f"{root}/le").read_metadata().state_dict_metadata
    stored = sorted(
        k
        for k in md
        if k.startswith("model.layers.0.moe.local_experts.") and k.endswith(".w1.weight")
    )
    want_keys = sorted(f"model.layers.0.moe.local_experts.{e}.w1.weight" for e in range(8))
    if stored != want_keys:
        fail.append(f"{tag} stored expert keys {stored}")
    mesh2 = ml.build_mesh(ep=2)
    target = built(mesh2, 2, 99)
    ck.load(ml.SPEC, {"model": target.state_dict()}, f"{root}/le", mesh=mesh2)
    ep_rank = mesh2.get_coordinate()[mesh2.mesh_dim_names.index("ep")]
    want = moe.local_expert_state(full, ep_rank, 2, cfg)
    n = 0
    for name, p in target.named_parameters():
        got = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if not torch.equal(got, want[name]):
            fail.append(f"{tag} {name} on ep rank {ep_rank} differs")
        n += 1
    if n != len(ml.PARAMS):
        fail.append(f"{tag} checked {n} parameters")
    _count(tag)


# ----------------------------------------------------------------------------- locality


class _RecordingReader(dcp.FileSystemReader):
    """Records which data files this rank's reads touch."""

    def read_data(self, plan, planner):
        self.opened = sorted({self.storage_data[i.storage_index].relative_path for i in plan.items})
        return super().read_data(plan, planner)


def file_locality(mod: Any, mesh: Any, rank: int, root: str, fail: Failures) -> None:
    """Same mesh, same structure: each rank reads only the file it wrote, replicas get
    their chunks from the writer. Another mesh: ordinary resharding reads."""
    tag = "[locality]"
    model = _llama(mod, mesh, 1)
    extra = {"step": torch.tensor(7.0), "groups": [{"lr": 0.5}]}
    ck.save(mod.SPEC, {"model": model.state_dict(), "extra": extra}, f"{root}/loc", mesh=mesh)
    target = _llama(mod, mesh, 2)
    state = {
        "model": target.state_dict(),
        "extra": {"step": torch.tensor(0.0), "groups": [{"lr": 0.0}]},
    }
    reader = _RecordingReader(f"{root}/loc")
    planner = ck.load(mod.SPEC, state, f"{root}/loc", mesh=mesh, storage_reader=reader)
    if not getattr(planner, "active", False):
        fail.append(f"{tag} same-topology load did not use file locality")
    if reader.opened != [f"__{rank}_0.distcp"]:
        fail.append(f"{tag} rank {rank} opened {reader.opened}")
    bad = _same(_locals(model), _locals(target))
    if bad:
        fail.append(f"{tag} file-local load gave wrong values: {bad[:3]}")
    if float(state["extra"]["step"]) != 7.0 or state["extra"]["groups"] != [{"lr": 0.5}]:
        fail.append(f"{tag} replicated entries came back as {state['extra']}")
    _count(tag)
    other = mod.build_mesh(tp=1)
    target = _llama(mod, other, 3)
    state = {
        "model": target.state_dict(),
        "extra": {"step": torch.tensor(0.0), "groups": [{"lr": 0.0}]},
    }
    planner = ck.load(mod.SPEC, state, f"{root}/loc", mesh=other)
    if getattr(planner, "active", True):
        fail.append(f"{tag} locality was used on a different mesh")
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    bad = [n for n, p in target.named_parameters() if not torch.equal(p.full_tensor(), full[n])]
    if bad:
        fail.append(f"{tag} resharded load after a locality save is wrong: {bad[:3]}")
    _count(tag)


# ----------------------------------------------------------------------------- uncovered


def uncovered_entries(rank: int, root: str, fail: Failures) -> None:
    """A state dict whose state-dict hooks write keys no rule places (torchtitan-like
    ``wqkv`` presented as ``wq``/``wk``/``wv``): ``save`` refuses it on every rank before a
    byte is written (synchronous and asynchronous alike); ``strict=False`` saves it with a
    warning, and it loads back; the parameters under their own names, with entries that
    are not the model's (a step counter, an RNG state), save without a word."""
    import importlib
    import warnings

    from examples.models import llama3_fused

    tag = "[uncovered]"
    # The golden module compiled from the model's manifest (with its HOOK_KEYS).
    mod = importlib.import_module("tests.cases.state_dict_hooks.expected")
    mesh = mod.build_mesh()  # dp_shard 2 x tp 2
    model = llama3_fused.tiny()
    llama.init_weights(model, 1)
    mod.distribute(model, mesh)
    hooked = {"model": model.state_dict(), "optim": {"step": 3}}
    path = f"{root}/hooked"
    want = [
        "model.layers.0.attention.wq.weight (written by a state-dict hook of "
        "layers.0.attention in place of layers.0.attention.qkv_linear.wqkv.weight)",
        "model.layers.1.attention.wv.weight",
        "6 state-dict entries of the model",
        "nothing was saved",
        "strict=False",
    ]
    err = _expect_error(lambda: mod.save(hooked, path, mesh=mesh), *want)
    if err:
        fail.append(f"{tag} a hooked state dict: {err}")
    err = _expect_error(lambda: mod.save(hooked, path, asynchronous=True).result(), *want)
    if err:
        fail.append(f"{tag} a hooked state dict, asynchronous: {err}")
    dist.barrier()
    left = [p for p in (path, f"{path}.partial") if os.path.exists(p)]
    if left:
        fail.append(f"{tag} a refused save left {left}")
    dist.barrier()  # every rank has looked before the next save (rank 0 makes .partial)
    _count(tag)
    # strict=False: every rank warns, the hooks' keys are stored whole, and they load back
    # through the model's own load_state_dict pre-hook (on the same mesh: file locality,
    # which shares such entries by key, must not hand one rank's chunk to another).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod.save(hooked, path, mesh=mesh, strict=False)
    said = [str(w.message) for w in caught if issubclass(w.category, ck.UncoveredEntriesWarning)]
    if len(said) != 1 or "model.layers.0.attention.wk.weight" not in said[0]:
        fail.append(f"{tag} strict=False warned {said}")
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if "model.layers.0.attention.wq.weight" not in stored:
        fail.append(f"{tag} strict=False did not store the hooks' keys: {sorted(stored)[:5]}")
    target = llama3_fused.tiny()
    llama.init_weights(target, 2)
    mod.distribute(target, mesh)
    state = {"model": target.state_dict(), "optim": {"step": 0}}
    mod.load(state, path, mesh=mesh)
    target.load_state_dict(state["model"])
    bad = _same(_locals(model), _locals(target))
    if bad or state["optim"]["step"] != 3:
        fail.append(f"{tag} strict=False checkpoint loaded back wrong: {bad[:3]}")
    _count(tag)
    # The parameters under their own names (no hooks), optimizer-like state that names
    # them, and entries outside the model: covered, no warning.
    own = {name: p for name, p in model.named_parameters()}
    moments = {f"{n}.exp_avg": torch.zeros_like(p) for n, p in own.items()}
    extra = {"step": torch.tensor(7.0), "rng": torch.arange(5), "groups": [{"lr": 0.5}]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod.save({"model": own, "optim": moments, "extra": extra}, f"{root}/own", mesh=mesh)
    said = [str(w.message) for w in caught if issubclass(w.category, ck.UncoveredEntriesWarning)]
    if said:
        fail.append(f"{tag} a covered state dict warned: {said}")
    if not os.path.exists(f"{root}/own/{ck.MARKER}"):
        fail.append(f"{tag} a covered state dict was not saved")
    _count(tag)


# ----------------------------------------------------------------------------- driver


def run_all(rank: int, world: int, root: str) -> tuple[Failures, dict[str, int]]:
    from torch.distributed.device_mesh import init_device_mesh

    import generated.llama as mod

    fail: Failures = []
    mesh = mod.build_mesh(tp=2)
    mesh1d = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    steps: list[tuple[str, Callable[[], None]]] = [
        ("caching", lambda: plan_caching(mod, mesh, rank, root, fail)),
        ("validation", lambda: validation(mod, mesh, rank, root, fail)),
        ("ignore", lambda: ignored_entries(root, rank, fail)),
        ("bad-files", lambda: bad_checkpoints(mod, mesh, rank, root, fail)),
        ("failed-save", lambda: failed_save(mod, mesh, rank, root, fail)),
        ("empty", lambda: empty_shards(mesh1d, rank, root, fail)),
        ("locality", lambda: file_locality(mod, mesh, rank, root, fail)),
        ("ckpt-placement", lambda: checkpoint_placement(rank, root, fail)),
        ("local-experts-ep", lambda: local_experts_resized(rank, root, fail)),
        ("uncovered", lambda: uncovered_entries(rank, root, fail)),
    ]
    for name, step in steps:
        try:
            step()
        except Exception:
            fail.append(f"[{name}] raised:\n{traceback.format_exc()}")
        dist.barrier()
    return fail, dict(CHECKED)
