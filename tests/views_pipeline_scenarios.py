"""Multi-rank scenarios for ``tests/test_views_pipeline.py``: pipeline stages on a folded
spec (views that share the pipeline axis), on 4 gloo ranks in one spawn.

The spec (:data:`PP_FOLDED`, compiled by the test) is the example MoE
(examples/models/moe.py) with a dense view (pp 2, fsdp 2) and an expert view (pp 2, ep 2,
efsdp 1) over the same 4 ranks, a pipeline over its two layers.

* ``groups``: ``build_mesh`` makes one process group per axis, the shared pp axis's once
  (the same group in both views), each view's DeviceMesh torch's of its shape; counted
  with and without a view whose own axes are one axis (:func:`check_group_counts`).
* ``stages``: each rank's stage is its coordinate on the shared pp axis (rank // 2 in both
  views); ``pipeline_group`` is torch's pp group of that shape, and the stage functions
  take the views as a single-mesh spec takes its DeviceMesh.
* ``split``: ``split_stage`` cuts the whole model to the rank's stage and ``distribute``
  places each kept parameter on its view's DeviceMesh: every local shard and full tensor
  is the single-process model's, bitwise.
* Checkpoints between the pipelined fold and the unpipelined folds of
  specs/deepseek_moe_folded.shard: saved from the stage models at pp 2, loaded at dense
  (fsdp 2, tp 2) x expert (ep 2, efsdp 2) and at ep 4; and saved at ep 2 x efsdp 2, loaded
  into the stage models. Each load starts from other values and must give the
  single-process model's tensors bitwise.
* ``hf``: Qwen3-MoE's per-expert HF keys (saved by transformers) load into the stage models,
  each rank reading exactly its shards' bytes; export_hf from them writes transformers'
  files again, bitwise.
* ``ties``: the same spec for the MoE with its head tied to its embedding (as transformers
  ties them): ``broadcast_tied`` copies the embedding over the last stage's perturbed copy
  and ``reduce_tied_grads`` sums the two stages' gradients, given the views.

Scenarios record failures (:class:`shardspec.testing.Checks`) rather than raise, so one
rank's failed check never leaves the others waiting in a collective.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from examples.models import moe
from shardspec.testing import Checks
from tests import views_scenarios as vs

SPECS = Path(__file__).resolve().parent.parent / "specs"

# The rules of specs/deepseek_moe_folded.shard without tp, and a pipeline over the layers.
PP_FOLDED = """\
manifest "{manifest}"
mesh dense over 4 ranks {{
    pp: 2
    fsdp: *{dense_tp}
}}
mesh expert {{
    pp: 2
    ep: 2
    efsdp: *
}}
fsdp fsdp
fsdp efsdp
ignore **._extra_state
pipeline pp {{
    first embed
    split layers.{{layer}}
    last hc_head, norm, head{tie}
}}
param layers.*.moe.experts.w{{1,3}} [expert, ffn, hidden] {{
    shard expert over ep
    style expert_parallel
}}
param layers.*.moe.experts.w2 [expert, hidden, ffn] {{
    shard expert over ep
    style expert_parallel
}}
param layers.*.moe.router.weight [expert, hidden] {{
    view dense
}}
param layers.*.attn.w{{q,k,v}}.weight [out, hidden] {{}}
param layers.*.attn.wo.weight [hidden, heads] {{}}
param embed.weight [vocab, hidden] {{}}
param **.*norm.weight [dim] {{}}
param *head.* [vocab, hidden] {{}}
param hc_head.* replicate
"""
TIE = "\n    tie head.weight = embed.weight"
DENSE_TP = "\n    tp: 1"


def spec_text(manifest: str, tied: bool = False) -> str:
    """The pipelined folded spec over ``manifest``, with the hf block of
    specs/deepseek_moe_folded.shard (Qwen3-MoE's keys); with ``tied``, the tied model's,
    without an hf block, whose dense view also has a tp axis (of size 1: no view's own
    axes are then one axis, the other way build_mesh shares the pp group)."""
    text = PP_FOLDED.format(
        manifest=manifest, tie=TIE if tied else "", dense_tp=DENSE_TP if tied else ""
    )
    if tied:
        return text
    folded = (SPECS / "deepseek_moe_folded.shard").read_text(encoding="utf-8")
    block = folded[folded.index('\nhf "deepseek_moe.hf.json" {') :]
    return text + block.replace('"deepseek_moe.hf.json"', f'"{SPECS / "deepseek_moe.hf.json"}"')


def tied_moe() -> nn.Module:
    """The tiny MoE with its head's weight *being* its embedding's (transformers' way)."""
    model = moe.tiny()
    assert model.head is not None
    model.head.weight = model.embed.weight
    return model


def load_module(path: str) -> Any:
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _stage_model(mod: Any, views: Any, seed: int, tied: bool = False) -> nn.Module:
    model = tied_moe() if tied else moe.tiny()
    moe.init_weights(model, seed)
    mod.split_stage(model, views)
    mod.distribute(model, views)
    return model


def check_stages(checks: Checks, mod: Any, rank: int) -> None:
    """A rank's stage, the pipeline group and the stage tables, given the views."""
    views = mod.build_mesh()
    tag = "stages"
    stage = mod.stage_of(views)
    checks.check(tag, stage == rank // 2, f"stage {stage}, not {rank // 2}")
    for view in views:
        coord = views[view].get_coordinate()
        checks.check(tag, coord[0] == stage, f"view {view}: pp coordinate {coord}")
    torch_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "rest"))
    got = dist.get_process_group_ranks(mod.pipeline_group(views))
    want = dist.get_process_group_ranks(torch_mesh.get_group("pp"))
    checks.check(tag, got == want == [rank % 2, rank % 2 + 2], f"pp group {got} != {want}")
    checks.check(tag, mod.num_stages(views) == 2, f"{mod.num_stages(views)} stages")
    layers = mod.stage_layers(views)
    checks.check(tag, layers == [str(stage)], f"stage {stage} holds layers {layers}")
    names = set(mod.stage_params(views))
    head = {"embed.weight"} if stage == 0 else {"norm.weight", "head.weight", "hc_head.fn"}
    checks.check(tag, head <= names, f"stage {stage} lacks {sorted(head - names)}")


def groups_made(build: Any) -> tuple[Any, int, int]:
    """``build()``'s result, the ``new_group`` calls it made (every rank makes every
    group) and the groups this rank joined."""
    from torch.distributed import distributed_c10d as c10d

    calls, joined = c10d._world.group_count, len(c10d._world.pg_map)
    out = build()
    return out, c10d._world.group_count - calls, len(c10d._world.pg_map) - joined


def check_groups(
    checks: Checks, tag: str, mod: Any, rank: int, joined_want: int, calls_want: int
) -> None:
    """build_mesh of ``mod``'s views: torch's meshes, the pp group one group for both
    views, ``joined_want`` groups joined by this rank, ``calls_want`` new_group calls."""
    views, calls, joined = groups_made(mod.build_mesh)
    vs.check_views_are_torchs(checks, f"{tag} views", mod, views, {}, rank)
    dense, expert = views["dense"], views["expert"]
    checks.check(tag, dense.get_group("pp") is expert.get_group("pp"), "two pp groups")
    checks.check(tag, joined == joined_want, f"joined {joined} groups, not {joined_want}")
    checks.check(tag, calls == calls_want, f"{calls} new_group calls, not {calls_want}")


def check_group_counts(checks: Checks, mod: Any, tied: Any, rank: int) -> None:
    """build_mesh makes one process group per axis, a shared axis's once (it was one per
    view: two groups of the same ranks).

    * ``mod``'s views, dense (pp 2, fsdp 2) and expert (pp 2, ep 2, efsdp 1): four axes,
      4 groups joined; the new_group calls are the subgroups of pp, fsdp (the world's rest,
      which the expert view unflattens), ep and efsdp (size 1: a group per rank):
      2 + 2 + 2 + 4. Before: 5 joined, 12 calls.
    * ``tied``'s, dense (pp 2, fsdp 2, tp 1) and expert (pp 2, ep 2, efsdp 1): no view's
      own axes are one axis, so the rest has a group of its own: 6 joined (pp, rest, fsdp,
      tp, ep, efsdp) and 2 + 2 + 2 + 4 + 2 + 4 calls, as many as one pp group per view.
    * A spec whose views share no axis (specs/deepseek_moe_folded.shard at fsdp 2, tp 2,
      ep 2, efsdp 2): each view's axes, as before: 4 joined, 8 calls."""
    check_groups(checks, "groups", mod, rank, 4, 10)
    check_groups(checks, "groups, no single own axis", tied, rank, 6, 16)
    folded = importlib.import_module(vs.FOLDED)
    _, calls, joined = groups_made(lambda: folded.build_mesh(**vs.FOLD_A))
    checks.check("groups", (joined, calls) == (4, 8), f"folded: {joined} joined, {calls} calls")


def check_split(checks: Checks, mod: Any, ref: dict[str, torch.Tensor]) -> None:
    """split_stage then distribute: each kept parameter on its view, the reference's."""
    views = mod.build_mesh()
    model = _stage_model(mod, views, vs.SEED)
    names = [n for n, _ in model.named_parameters()]
    want = sorted(mod.stage_params(views))
    checks.check("split", sorted(names) == want, f"holds {sorted(names)}, not {want}")
    vs.compare(checks, "split", mod, model, views, ref)
    w1 = model.get_parameter(f"layers.{mod.stage_of(views)}.moe.experts.w1")
    checks.check(
        "split",
        tuple(w1.device_mesh.mesh_dim_names) == ("ep", "efsdp"),
        f"experts on {w1.device_mesh.mesh_dim_names}",
    )


def _load_stages(checks: Checks, tag: str, mod: Any, path: str, ref: dict) -> None:
    views = mod.build_mesh()
    model = _stage_model(mod, views, vs.OTHER)
    name, first = next(iter(model.named_parameters()))
    checks.check(tag, not torch.equal(first.full_tensor(), ref[name]), "starts equal")
    mod.load({"model": model.state_dict()}, path, mesh=views)
    vs.compare(checks, tag, mod, model, views, ref)


def check_checkpoints(checks: Checks, mod: Any, root: str, ref: dict) -> None:
    """Stage models at pp 2 <-> the folds of specs/deepseek_moe_folded.shard at pp 1."""
    folded = importlib.import_module(vs.FOLDED)
    a = os.path.join(root, "pp2")
    views = mod.build_mesh()
    model = _stage_model(mod, views, vs.SEED)
    mod.save({"model": model.state_dict()}, a, mesh=views)
    del model, views
    vs._load_and_compare(checks, "load pp 2 at ep 2 x efsdp 2, tp 2", folded, vs.FOLD_A, a, ref)
    vs._load_and_compare(checks, "load pp 2 at ep 4", folded, vs.FOLD_EP4, a, ref)
    b = os.path.join(root, "fold-a")
    vs._save(folded, vs.FOLD_A, b)
    _load_stages(checks, "load ep 2 x efsdp 2, tp 2 at pp 2", mod, b, ref)


def check_hf(checks: Checks, mod: Any, root: str, hf_dir: str) -> None:
    """Qwen3-MoE's per-expert keys (saved by transformers) load into the stage models at
    pp 2, each rank reading only its stage's and its experts' bytes, every mapped
    parameter the owner's tensor; export_hf from the stage models writes transformers' own
    files again, bitwise."""
    hf, owner = vs.hf_and_owner(hf_dir)
    views = mod.build_mesh()
    model = _stage_model(mod, views, vs.OTHER)
    out = os.path.join(root, "export-pp2")
    vs.check_hf_round_trip(checks, "at pp 2", mod, model, views, hf_dir, hf, owner, out)


def check_ties(checks: Checks, mod: Any) -> None:
    """broadcast_tied and reduce_tied_grads across the two stages, given the views."""
    views = mod.build_mesh()
    stage = mod.stage_of(views)
    model = _stage_model(mod, views, vs.SEED, tied=True)
    ref = tied_moe()
    moe.init_weights(ref, vs.SEED)
    source = ref.embed.weight.detach()
    name = "embed.weight" if stage == 0 else "head.weight"
    p = model.get_parameter(name)
    assert isinstance(p, DTensor)
    with torch.no_grad():
        if stage == 1:  # the last stage's copy drifts
            p.to_local().add_(1.0)
    mod.broadcast_tied(model, views)
    checks.check("ties", torch.equal(p.full_tensor(), source), f"{name} is not the source's")
    # gradients: stage s holds (s + 1) * ones; the sum over the stages is 3 * ones
    p.grad = DTensor.from_local(
        torch.full_like(p.to_local(), float(stage + 1)), p.device_mesh, p.placements
    )
    mod.reduce_tied_grads(model, views)
    got = p.grad.full_tensor()
    checks.check("ties", torch.equal(got, torch.full_like(got, 3.0)), f"{name}.grad not summed")


def run_all(
    rank: int, world: int, root: str, hf_dir: str, module: str, tied_module: str
) -> dict[str, Any]:
    """Every scenario on this rank: failures and the checks made per tag."""
    checks = Checks()
    mod = load_module(module)
    ref = vs._reference()
    tied = load_module(tied_module)
    check_group_counts(checks, mod, tied, rank)
    check_stages(checks, mod, rank)
    check_split(checks, mod, ref)
    check_checkpoints(checks, mod, root, ref)
    check_hf(checks, mod, root, hf_dir)
    check_ties(checks, tied)
    return {"fail": checks.fail, "count": checks.count}
