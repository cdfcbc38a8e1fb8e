"""Multi-rank scenarios for ``tests/test_dist.py``, run on gloo CPU ranks by
:func:`shardspec.testing.run_ranks` (module level, so spawned ranks can import them).

Every scenario appends failure strings (``"<scenario> <param>: what differs"``) instead of
raising, so one rank's failed check never leaves the others waiting in a collective, and the
parent sees every difference at once. :func:`run_all` runs all scenarios of one world size in
one spawn.
"""

from __future__ import annotations

import copy
import importlib
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from examples.models import llama, moe
from shardspec.core.layout import LayoutProblem, dtensor_mesh
from shardspec.runtime import CompiledSpec, RuleSpec, SpecError
from shardspec.runtime.dtensor import distribute, take, to_torch

SEED = 1234
Failures = list[str]
CHECKED: dict[str, int] = {}  # scenario tag -> parameters checked on this rank

# Expected per-axis placements, written out by hand from the specs (an oracle independent of
# the compiler): generated module -> rule pattern -> {axis: placement}; absent axes are
# Replicate, "*" is every other rule. ``n`` is the size of the model-parallel axis (tp or
# ep), which is FSDP's _StridedShard split factor.
S0, S1 = Shard(0), Shard(1)


def expected_table(modname: str, n: int) -> dict[str, dict[str, Placement]]:
    ss = _StridedShard(0, split_factor=n)
    return {
        "generated.llama": {
            "tok_embeddings.weight": {"dp_shard": ss, "tp": S0},
            "output.weight": {"dp_shard": ss, "tp": S0},
            "layers.*.attention.wqkv.weight": {"dp_shard": ss, "tp": S0},
            "layers.*.attention.wo.weight": {"dp_shard": S0, "tp": S1},
            # FSDP on hidden; tp splits gate and up separately: 2 components, outer to tp.
            "layers.*.feed_forward.w13.weight": {
                "dp_shard": S1,
                "tp": _StridedShard(0, split_factor=2),
            },
            "layers.*.feed_forward.w2.weight": {"dp_shard": S0, "tp": S1},
            "**.*norm.weight": {"dp_shard": S0},
        },
        "generated.deepseek_moe": {
            "layers.*.moe.experts.w{1,3}": {"dp_shard": ss, "ep": S0},
            "layers.*.moe.experts.w2": {"dp_shard": ss, "ep": S0},
            "hc_head.*": {},
            "*": {"dp_shard": S0},
        },
        "generated.deepseek_moe_local": {
            "layers.*.moe.local_experts.{expert}.w{1,3}.weight": {"dp_shard": S0},
            "layers.*.moe.local_experts.{expert}.w2.weight": {"dp_shard": S0},
            "hc_head.*": {},
            "*": {"dp_shard": S0},
        },
    }[modname]


# The DTensor mesh of Megatron-style local experts: the EP axis is local, FSDP only.
LOCAL_EXPERT_MESH = ("dp_shard",)


# --------------------------------------------------------------------------- helpers


def effective(p: DTensor) -> dict[str, Placement]:
    """``{axis: placement}`` of a DTensor, Replicate axes left out."""
    names = p.device_mesh.mesh_dim_names or ()
    return {
        n: pl for n, pl in zip(names, p.placements, strict=True) if not isinstance(pl, Replicate)
    }


def expected_effective(modname: str, mod: Any, fqn: str, mesh: DeviceMesh) -> dict[str, Placement]:
    rule, _ = mod.SPEC.match(fqn)
    names = mesh.mesh_dim_names or ()
    n = mesh.size(names.index("tp" if "tp" in names else "ep"))
    table = expected_table(modname, n)
    pattern = mod.RULES[rule].pattern
    return table[pattern] if pattern in table else table["*"]


def factory(mod: Any) -> Callable[..., nn.Module]:
    module_name, func = mod.FACTORY.split(":")
    return getattr(importlib.import_module(module_name), func)


def init_fn(mod: Any) -> Callable[..., None]:
    return llama.init_weights if "llama" in mod.FACTORY else moe.init_weights


def coord_of(mesh: DeviceMesh, axis: str) -> int:
    coord = mesh.get_coordinate()
    assert coord is not None
    return coord[(mesh.mesh_dim_names or ()).index(axis)]


def check_param(
    tag: str,
    mod: Any,
    modname: str,
    fqn: str,
    p: Any,
    mesh: DeviceMesh,
    rank: int,
    original: torch.Tensor | None,
    fail: Failures,
) -> None:
    """One distributed parameter against the compiled layout.

    ``original`` is the global tensor the DTensor describes (for a local-expert module: that
    expert's full weight); ``None`` on the meta device.
    """
    where = f"{tag} {fqn}"
    CHECKED[tag] = CHECKED.get(tag, 0) + 1
    if not isinstance(p, DTensor):
        fail.append(f"{where}: not a DTensor but {type(p).__name__}")
        return
    spec = mod.SPEC
    lmesh = spec.layout_mesh(mesh)
    layout = spec.layout(fqn, lmesh)
    names = tuple(p.device_mesh.mesh_dim_names or ())
    if names != dtensor_mesh(layout, lmesh).names:
        fail.append(f"{where}: mesh axes {names}, layout says {dtensor_mesh(layout, lmesh).names}")
    want = tuple(mod.placements(fqn, mesh))
    if tuple(p.placements) != want:
        fail.append(f"{where}: placements {p.placements}, compiled {want}")
    abstract = tuple(to_torch(x) for x in spec.abstract_placements(fqn, mesh))
    if abstract != tuple(p.placements):
        fail.append(f"{where}: placements {p.placements}, SPEC.abstract_placements {abstract}")
    spec_says = expected_effective(modname, mod, fqn, mesh)
    if effective(p) != spec_says:
        fail.append(f"{where}: placements {effective(p)}, spec says {spec_says}")
    table = spec.rank_table(fqn, mesh)
    mine = table[rank]
    if mine.rank != rank or tuple(mine.coord) != tuple(mesh.get_coordinate() or ()):
        fail.append(f"{where}: rank table row {mine.rank} {mine.coord} for rank {rank}")
    tensor_idx = tuple(
        r for d, r in zip(layout.dims, mine.indices, strict=True) if not d.name_indexed
    )
    local = p.to_local()
    want_shape = tuple(sum(b - a for a, b in r) for r in tensor_idx)
    if tuple(local.shape) != want_shape:
        fail.append(f"{where}: local shape {tuple(local.shape)}, rank table {want_shape}")
    if tuple(p.shape) != tuple(mod.PARAMS[fqn].shape):
        fail.append(f"{where}: global shape {tuple(p.shape)}, manifest {mod.PARAMS[fqn].shape}")
    if original is None:
        if not local.is_meta:
            fail.append(f"{where}: expected a meta local tensor, got {local.device}")
        return
    if tuple(original.shape) != tuple(p.shape):
        fail.append(f"{where}: original {tuple(original.shape)} vs DTensor {tuple(p.shape)}")
        return
    if not torch.equal(local, take(original, tensor_idx)):
        fail.append(f"{where}: local values differ from the original at the table's indices")
    if not torch.equal(p.full_tensor(), original):
        fail.append(f"{where}: full_tensor() differs from the original")


def distribute_and_check(
    tag: str,
    modname: str,
    mesh: DeviceMesh,
    rank: int,
    fail: Failures,
    model: nn.Module,
    originals: dict[str, torch.Tensor],
) -> None:
    mod = importlib.import_module(modname)
    mod.distribute(model, mesh)
    names = [f for f, _ in model.named_parameters()]
    if sorted(names) != sorted(mod.PARAMS):
        fail.append(f"{tag}: model params differ from the manifest")
    for fqn, p in model.named_parameters():
        check_param(tag, mod, modname, fqn, p, mesh, rank, originals[fqn], fail)


# --------------------------------------------------------------------------- scenarios


def full_weights(modname: str, mesh: DeviceMesh, rank: int, fail: Failures) -> None:
    """A full model (every rank the same weights) cut into its shards, no communication."""
    mod = importlib.import_module(modname)
    model = factory(mod)(**mod.FACTORY_ARGS)
    init_fn(mod)(model, SEED)
    originals = {k: v.detach().clone() for k, v in model.named_parameters()}
    distribute_and_check(f"[full {modname}]", modname, mesh, rank, fail, model, originals)


def meta_then_init(modname: str, mesh: DeviceMesh, rank: int, fail: Failures) -> None:
    """Build on meta, distribute, materialise, initialise, compare with a plain init."""
    tag = f"[meta {modname}]"
    mod = importlib.import_module(modname)
    with torch.device("meta"):
        model = factory(mod)(**mod.FACTORY_ARGS)
    mod.distribute(model, mesh)
    for fqn, p in model.named_parameters():
        check_param(tag, mod, modname, fqn, p, mesh, rank, None, fail)
    model.to_empty(device="cpu")
    init_fn(mod)(model, SEED)
    ref = factory(mod)(**mod.FACTORY_ARGS)
    init_fn(mod)(ref, SEED)
    ref_params = dict(ref.named_parameters())
    for fqn, p in model.named_parameters():
        check_param(tag, mod, modname, fqn, p, mesh, rank, ref_params[fqn].detach(), fail)


def local_experts(mesh: DeviceMesh, rank: int, fail: Failures) -> None:
    """Megatron-style local experts: each EP rank's modules hold its own experts."""
    modname = "generated.deepseek_moe_local"
    tag = f"[local {modname}]"
    mod = importlib.import_module(modname)
    ep = mesh.size((mesh.mesh_dim_names or ()).index("ep"))
    ep_rank = coord_of(mesh, "ep")
    ref = moe.tiny()
    moe.init_weights(ref, SEED)
    ref_state = {k: v.detach().clone() for k, v in ref.named_parameters()}
    model = moe.tiny_local(ep=ep)
    cfg = model.config
    result = model.load_state_dict(
        moe.local_expert_state(ref_state, ep_rank, ep, cfg), strict=False
    )
    if result.unexpected_keys or any(not k.endswith("._extra_state") for k in result.missing_keys):
        fail.append(f"{tag}: local_expert_state does not fit the local model: {result}")
    mod.distribute(model, mesh)
    lmesh = mod.SPEC.layout_mesh(mesh)
    seen_experts: set[int] = set()
    for fqn, p in model.named_parameters():
        parts = fqn.split(".")
        if "local_experts" not in parts:
            check_param(tag, mod, modname, fqn, p, mesh, rank, ref_state[fqn], fail)
            continue
        # layers.{i}.moe.local_experts.{j}.w{k}.weight
        layer, j, w = parts[1], int(parts[4]), parts[5]
        layout = mod.SPEC.layout(fqn, lmesh)
        vdim = next(d for d, dim in enumerate(layout.dims) if dim.name_indexed)
        vranges = mod.SPEC.rank_table(fqn, mesh)[rank].indices[vdim]
        if len(vranges) != 1 or vranges[0][1] - vranges[0][0] != cfg.n_local_experts:
            fail.append(f"{tag} {fqn}: expert indices {vranges} on EP rank {ep_rank}")
            continue
        expert = vranges[0][0] + j  # the compiler's global expert index
        if expert != ep_rank * cfg.n_local_experts + j:
            fail.append(f"{tag} {fqn}: compiler says expert {expert}")
        seen_experts.add(expert)
        if not isinstance(p, DTensor) or tuple(p.device_mesh.mesh_dim_names) != LOCAL_EXPERT_MESH:
            fail.append(f"{tag} {fqn}: not a DTensor on the dp_shard-only mesh")
            continue
        original = ref_state[f"layers.{layer}.moe.experts.{w}"][expert]
        check_param(tag, mod, modname, fqn, p, mesh, rank, original, fail)
    want = set(range(ep_rank * cfg.n_local_experts, (ep_rank + 1) * cfg.n_local_experts))
    if seen_experts != want:
        fail.append(f"{tag}: experts {sorted(seen_experts)} on EP rank {ep_rank}, want {want}")


def dense_vs_torch(mesh: DeviceMesh, rank: int, fail: Failures) -> None:
    """The dense spec against torch's own ``parallelize_module`` + ``fully_shard``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tag = "[torch-vs-spec generated.llama]"
    mod = importlib.import_module("generated.llama")
    ref = llama.tiny()
    llama.init_weights(ref, SEED)
    original = {k: v.detach().clone() for k, v in ref.named_parameters()}

    theirs = copy.deepcopy(ref)
    plan: dict[str, Any] = {"tok_embeddings": RowwiseParallel(), "output": ColwiseParallel()}
    for i in theirs.layers:
        plan[f"layers.{i}.attention.wqkv"] = ColwiseParallel()
        plan[f"layers.{i}.attention.wo"] = RowwiseParallel()
        plan[f"layers.{i}.feed_forward.w13"] = ColwiseParallel()
        plan[f"layers.{i}.feed_forward.w2"] = RowwiseParallel()
    parallelize_module(theirs, mesh["tp"], plan)
    w13 = {id(b.feed_forward.w13.weight) for b in theirs.layers.values()}

    def placement_fn(param: nn.Parameter) -> Shard | None:
        # The spec puts FSDP on w13's hidden dim, since ffn is split per component.
        return Shard(1) if id(param) in w13 else None

    for block in theirs.layers.values():
        fully_shard(block, mesh=mesh["dp_shard"], shard_placement_fn=placement_fn)
    fully_shard(theirs, mesh=mesh["dp_shard"], shard_placement_fn=placement_fn)

    ours = copy.deepcopy(ref)
    mod.distribute(ours, mesh)
    ours_params = dict(ours.named_parameters())
    ffn = ref.config.ffn_dim
    tp_rank = coord_of(mesh, "tp")
    for fqn, tp_param in theirs.named_parameters():
        where = f"{tag} {fqn}"
        CHECKED[tag] = CHECKED.get(tag, 0) + 1
        sp = ours_params[fqn]
        if not isinstance(tp_param, DTensor) or not isinstance(sp, DTensor):
            fail.append(f"{where}: torch or shardspec did not give a DTensor")
            continue
        if not torch.equal(tp_param.full_tensor(), original[fqn]):
            fail.append(f"{where}: torch's full_tensor() differs from the original")
        mine, torchs = effective(sp), effective(tp_param)
        if fqn.endswith("feed_forward.w13.weight"):
            # torch's ColwiseParallel cuts the fused dim contiguously: tp rank 0 holds all of
            # gate, tp rank 1 all of up. The spec splits each component (_StridedShard).
            want_torch = {"dp_shard": Shard(1), "tp": Shard(0)}
            want_ours = {"dp_shard": Shard(1), "tp": _StridedShard(0, split_factor=2)}
            if torchs != want_torch or mine != want_ours:
                fail.append(
                    f"{where}: torch {torchs}, shardspec {mine}; expected exactly "
                    f"{want_torch} vs {want_ours}"
                )
            n_tp = mesh.size((mesh.mesh_dim_names or ()).index("tp"))
            t_shape, t_off = compute_local_shape_and_global_offset(
                tp_param.shape, tp_param.device_mesh, tp_param.placements
            )
            rows = range(t_off[0], t_off[0] + t_shape[0])
            cols = slice(t_off[1], t_off[1] + t_shape[1])
            if not torch.equal(tp_param.to_local(), original[fqn][rows.start : rows.stop, cols]):
                fail.append(f"{where}: torch's local tensor is not rows {rows}, cols {cols}")
            # The 2F % TP bug: a contiguous half of [gate; up] is all gate or all up.
            side = range(0, ffn) if tp_rank < n_tp // 2 else range(ffn, 2 * ffn)
            if rows.start not in side or rows.stop - 1 not in side:
                fail.append(f"{where}: torch's tp rank {tp_rank} rows {rows} straddle gate/up")
            part = ffn // n_tp
            want_rows = (
                (tp_rank * part, (tp_rank + 1) * part),
                (ffn + tp_rank * part, ffn + (tp_rank + 1) * part),
            )
            got = mod.SPEC.rank_table(fqn, mesh)[rank].indices[0]
            if got != want_rows:
                fail.append(f"{where}: shardspec rows {got}, want gate and up slices {want_rows}")
            idx = mod.SPEC.rank_table(fqn, mesh)[rank].indices
            if not torch.equal(sp.to_local(), take(original[fqn], idx)):
                fail.append(f"{where}: shardspec's local tensor is not its gate and up slices")
            continue
        if mine != torchs:
            fail.append(f"{where}: torch {torchs} vs shardspec {mine}")
            continue
        t_local, s_local = tp_param.to_local(), sp.to_local()
        t_so = compute_local_shape_and_global_offset(
            tp_param.shape, tp_param.device_mesh, tp_param.placements
        )
        s_so = compute_local_shape_and_global_offset(sp.shape, sp.device_mesh, sp.placements)
        if tuple(t_so[0]) != tuple(s_so[0]) or tuple(t_so[1]) != tuple(s_so[1]):
            fail.append(f"{where}: torch local shape/offset {t_so}, shardspec {s_so}")
        if tuple(t_local.shape) != tuple(s_local.shape) or not torch.equal(t_local, s_local):
            fail.append(
                f"{where}: local tensors differ (torch {tuple(t_local.shape)}, "
                f"shardspec {tuple(s_local.shape)})"
            )


def errors(mesh: DeviceMesh, rank: int, fail: Failures) -> None:
    """Mismatched models and meshes raise SpecError and leave the model alone."""
    tag = "[errors generated.llama]"
    mod = importlib.import_module("generated.llama")
    CHECKED[tag] = 0

    def expect(what: str, fn: Callable[[], object], *needles: str) -> None:
        try:
            fn()
        except SpecError as e:
            CHECKED[tag] += 1
            missing = [n for n in needles if n not in str(e)]
            if missing:
                fail.append(f"{tag} {what}: SpecError without {missing}: {e}")
        except Exception as e:  # any other error is a failure to report
            fail.append(f"{tag} {what}: {type(e).__name__} instead of SpecError: {e}")
        else:
            fail.append(f"{tag} {what}: no error")

    def untouched(what: str, model: nn.Module, before: dict[str, torch.Tensor]) -> None:
        for fqn, p in model.named_parameters():
            if isinstance(p, DTensor) or not torch.equal(p.detach(), before[fqn]):
                fail.append(f"{tag} {what}: {fqn} was modified")

    # A parameter whose shape differs from the manifest.
    model = llama.tiny(ffn_dim=64)
    llama.init_weights(model, SEED)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    expect(
        "wrong shape",
        lambda: mod.distribute(model, mesh),
        "layers.0.feed_forward.w13.weight",
        "[128, 64]",
        "[192, 64]",
    )
    untouched("wrong shape", model, before)

    # A model that lacks a parameter of the manifest (tied embeddings: no output.weight).
    tied = llama.tiny_tied()
    before = {k: v.detach().clone() for k, v in tied.named_parameters()}
    expect("missing param", lambda: mod.distribute(tied, mesh), "lacks")
    untouched("missing param", tied, before)

    # An extra parameter the manifest does not know.
    extra = llama.tiny()
    extra.register_parameter("bonus", nn.Parameter(torch.zeros(3)))
    expect("extra param", lambda: mod.distribute(extra, mesh), "'bonus'")
    if any(isinstance(p, DTensor) for p in extra.parameters()):
        fail.append(f"{tag} extra param: the model was modified")

    # Wrong mesh axis names / order, no names.
    world = mesh.size()
    tp = mesh.size(1)
    bad_names = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    swapped = init_device_mesh("cpu", (tp, world // tp), mesh_dim_names=("tp", "dp_shard"))
    for what, m, needle in (("mesh names", bad_names, "dp"), ("mesh order", swapped, "tp")):
        fresh = llama.tiny()
        expect(what, lambda m=m, fresh=fresh: mod.distribute(fresh, m), needle, "build_mesh")
        if any(isinstance(p, DTensor) for p in fresh.parameters()):
            fail.append(f"{tag} {what}: the model was modified")
    expect("placements on a bad mesh", lambda: mod.placements("norm.weight", bad_names), "axes")

    # Distributing twice.
    twice = llama.tiny()
    mod.distribute(twice, mesh)
    expect("distribute twice", lambda: mod.distribute(twice, mesh), "already a DTensor")

    # Mesh sizes that do not fit the world.
    expect("tp=3", lambda: mod.build_mesh(tp=3), "world size")
    expect("unknown axis", lambda: mod.build_mesh(pp=2), "unknown mesh axis")


def runtime_paths(mesh: DeviceMesh, rank: int, fail: Failures) -> None:
    """Runtime paths the example modules do not take: specs without a manifest (rules matched
    by name, name-indexed counts counted from the model), tied parameters, rules that do not fit."""
    tag = "[runtime]"
    CHECKED[tag] = 0
    moe_local = importlib.import_module("generated.deepseek_moe_local")
    for modname, make, lm in (
        ("generated.llama", llama.tiny, mesh),
        ("generated.deepseek_moe_local", lambda: moe.tiny_local(ep=2), moe_local.build_mesh(ep=2)),
    ):
        mod = importlib.import_module(modname)
        a, b = make(), make()
        init_fn(mod)(a, SEED)
        b.load_state_dict(a.state_dict())
        mod.distribute(a, lm)
        distribute(_bare_spec(mod, mod.RULES), b, lm)
        pb = dict(b.named_parameters())
        for fqn, pa in a.named_parameters():
            CHECKED[tag] += 1
            q = pb[fqn]
            if not isinstance(q, DTensor):
                fail.append(f"{tag} {modname} {fqn}: not a DTensor without the manifest")
            elif (
                tuple(q.placements) != tuple(pa.placements)
                or q.device_mesh.mesh_dim_names != pa.device_mesh.mesh_dim_names
                or tuple(q.shape) != tuple(pa.shape)
                or not torch.equal(q.to_local(), pa.to_local())
            ):
                fail.append(f"{tag} {modname} {fqn}: manifest-less distribute differs")

    # Tied parameters: names with one layout stay tied; different layouts are an error.
    tied_rules = (
        RuleSpec("a.weight", ("x", "y"), (("x", ("tp",)),)),
        RuleSpec("b.weight", ("x", "y"), (("y", ("tp",)),)),
        RuleSpec("c.weight", ("x", "y"), (("x", ("tp",)),)),
    )
    spec = _bare_spec(importlib.import_module("generated.llama"), tied_rules)
    same = nn.ModuleDict({"a": nn.Linear(4, 4, bias=False), "c": nn.Linear(4, 4, bias=False)})
    same["c"].weight = same["a"].weight
    with torch.no_grad():
        same["a"].weight.copy_(torch.arange(16.0).view(4, 4))
    full = same["a"].weight.detach().clone()
    distribute(spec, same, mesh)
    CHECKED[tag] += 1
    if same["a"].weight is not same["c"].weight or not isinstance(same["a"].weight, DTensor):
        fail.append(f"{tag} tied: a.weight and c.weight are no longer one DTensor")
    elif not torch.equal(same["a"].weight.full_tensor(), full):
        fail.append(f"{tag} tied: values differ")
    differ = nn.ModuleDict({"a": nn.Linear(4, 4, bias=False), "b": nn.Linear(4, 4, bias=False)})
    differ["b"].weight = differ["a"].weight
    try:
        distribute(spec, differ, mesh)
    except SpecError as e:
        CHECKED[tag] += 1
        if "b.weight" not in str(e) or "a.weight" not in str(e) or "tied" not in str(e):
            fail.append(f"{tag} tied: SpecError does not name both: {e}")
    else:
        fail.append(f"{tag} tied: different layouts distributed without an error")
    if isinstance(differ["a"].weight, DTensor):
        fail.append(f"{tag} tied: the model was modified")

    # A rule that does not fit the tensor (no manifest to catch it first): SpecError, named.
    wrong = nn.ModuleDict({"a": nn.Linear(4, 4, bias=False)})
    wrong["a"].weight = nn.Parameter(torch.zeros(2, 3, 4))
    try:
        distribute(spec, wrong, mesh)
    except SpecError as e:
        CHECKED[tag] += 1
        if "a.weight" not in str(e) or e.problem is not LayoutProblem.DIM_COUNT:
            fail.append(f"{tag} wrong rank: {e.problem}: {e}")
    else:
        fail.append(f"{tag} wrong rank: no error")


def _bare_spec(mod: Any, rules: tuple[RuleSpec, ...]) -> CompiledSpec:
    """``mod``'s spec without its manifest: rules matched by name, shapes from the model."""
    return CompiledSpec(
        name=f"{mod.SPEC.name}-bare",
        axes=mod.AXES,
        sizes=mod.DEFAULT_SIZES,
        world=None,
        rules=rules,
        params=None,
        ignore=mod.IGNORE,
    )


# --------------------------------------------------------------------------- driver


def run_all(
    rank: int, world: int, plan: Sequence[tuple[str, str, dict[str, int]]]
) -> tuple[Failures, dict[str, int]]:
    """Run ``plan`` (scenario name, generated module, mesh sizes) on this rank.

    Meshes are built once per (module, sizes). A scenario that raises is reported with its
    traceback; the following ones still run. Returns the failures and, per scenario tag, how
    many parameters it checked (so a scenario that checked nothing is caught).
    """
    CHECKED.clear()
    fail: Failures = []
    meshes: dict[tuple[str, tuple[tuple[str, int], ...]], DeviceMesh] = {}
    for scenario, modname, sizes in plan:
        key = (modname, tuple(sorted(sizes.items())))
        try:
            if key not in meshes:
                meshes[key] = importlib.import_module(modname).build_mesh(**sizes)
            mesh = meshes[key]
            where = f"[{scenario} {modname} {sizes}]"
            n_before = len(fail)
            if scenario == "full":
                full_weights(modname, mesh, rank, fail)
            elif scenario == "meta":
                meta_then_init(modname, mesh, rank, fail)
            elif scenario == "local":
                local_experts(mesh, rank, fail)
            elif scenario == "torch":
                dense_vs_torch(mesh, rank, fail)
            elif scenario == "errors":
                errors(mesh, rank, fail)
            elif scenario == "runtime":
                runtime_paths(mesh, rank, fail)
            else:
                fail.append(f"unknown scenario {scenario}")
            fail[n_before:] = [f"{where} {m}" for m in fail[n_before:]]
        except Exception:  # report, go on with the next scenario
            fail.append(f"[{scenario} {modname} {sizes}] raised:\n{traceback.format_exc()}")
    return fail, dict(CHECKED)
