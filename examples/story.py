"""The demo's training story, on CPU ranks: ``parallelize`` the example Llama with the
generated layout (FSDP2 x TP), train a few AdamW steps, save a checkpoint, load it on
another mesh, continue training, and compare the continued run with the same
continuation from torch's own full-state reshard (they must agree bitwise).

Run by ``examples/demo.py``; each rank returns its lines for the parent to print.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from examples.models import llama

LR = 1e-3
BATCH, SEQ = 8, 33


def _batch(step: int, mesh) -> torch.Tensor:
    """This rank's part (over dp_shard) of the global batch of ``step``."""
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    dp = mesh["dp_shard"]
    return tokens.chunk(dp.size())[dp.get_local_rank()]


def _train(model, optim, steps: range, mesh) -> list[float]:
    losses = []
    for step in steps:
        optim.zero_grad()
        tokens = _batch(step, mesh)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optim.step()
        value = loss.detach().clone()
        dist.all_reduce(value, group=mesh["dp_shard"].get_group())
        losses.append(value.item() / mesh["dp_shard"].size())
    return losses


def _fresh(layout, mesh, seed: int):
    model = llama.tiny()
    llama.init_weights(model, seed)
    layout.parallelize(model, mesh)
    layout.verify(model, mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def train_story(rank: int, world: int, folder: str) -> list[str]:
    import logging
    import warnings

    import generated.llama as layout

    # FSDP2 warns that the root returns a view (an in-place op on the logits would skip its
    # backward hook; the demo does none), and DTensor that gathering a 2-D-sharded tensor
    # for the comparison takes two all-gathers.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    lines: list[str] = []

    def say(text: str) -> None:
        if rank == 0:
            lines.append(text)

    tp = 2 if world % 2 == 0 else 1
    mesh_a = layout.build_mesh(tp=tp)
    model, optim = _fresh(layout, mesh_a, seed=0)
    w13 = model.layers["0"].feed_forward.w13.weight
    say(
        f"[train] parallelize on {dict(zip(mesh_a.mesh_dim_names, mesh_a.shape, strict=True))}"
        f": w13 {tuple(w13.placements)} on {w13.device_mesh.mesh_dim_names}; verify passed"
    )
    losses = _train(model, optim, range(3), mesh_a)
    say(f"[train] 3 AdamW steps, losses {', '.join(f'{x:.4f}' for x in losses)}")
    path = os.path.join(folder, "ckpt")
    msd, osd = get_state_dict(model, optim)
    layout.save({"model": msd, "optim": osd}, path, mesh=mesh_a)
    say(f"[save] {path} (model and AdamW state, canonical layout)")
    full = StateDictOptions(full_state_dict=True)
    saved_m, saved_o = get_state_dict(model, optim, options=full)

    mesh_b = layout.build_mesh(tp=1)
    sizes_b = dict(zip(mesh_b.mesh_dim_names, mesh_b.shape, strict=True))
    runs = {}
    for how in ("load", "torch"):
        model_b, optim_b = _fresh(layout, mesh_b, seed=7)
        msd_b, osd_b = get_state_dict(model_b, optim_b)
        if how == "load":
            state = {"model": msd_b, "optim": osd_b}
            layout.load(state, path, mesh=mesh_b)
            set_state_dict(
                model_b, optim_b, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
        else:
            set_state_dict(
                model_b, optim_b, model_state_dict=saved_m, optim_state_dict=saved_o, options=full
            )
        losses = _train(model_b, optim_b, range(3, 6), mesh_b)
        params = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
            for k, v in model_b.state_dict().items()
        }
        runs[how] = (losses, params)
    (la, pa), (lb, pb) = runs["load"], runs["torch"]
    delta = max((pa[k] - pb[k]).abs().max().item() for k in pa)
    say(f"[load] on {sizes_b}, 3 more steps, losses {', '.join(f'{x:.4f}' for x in la)}")
    say(
        f"[load] continued run vs the same continuation from torch's full-state reshard: "
        f"losses {'equal' if la == lb else 'DIFFER'}, max parameter delta {delta}"
    )
    if la != lb or delta != 0.0:
        raise RuntimeError("the resumed run differs from torch's reshard of the same state")
    return lines
