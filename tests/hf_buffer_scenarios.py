"""Rank code for ``tests/test_hf_buffers.py``: transformers' own DeepseekV3ForCausalLM, used
as it is, whose router holds a persistent buffer (``mlp.gate.e_score_correction_bias``)
that its checkpoint stores as well.

The oracle is the model's owner: ``from_pretrained`` of the checkpoint gives transformers'
own state dict, parameters *and* persistent buffers. After ``load_hf`` every entry of the
model's state dict must equal it bitwise; ``export_hf`` must write every key of the
original checkpoint, bitwise; ``from_pretrained`` of the export must give the original's
logits; and a DCP checkpoint of the model (``save``/``load``) must keep the buffer, on the
same mesh and resharded. Failures are collected as strings (see ``dist_scenarios``).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from examples.models import hf as hfm
from tests.hf_scenarios import Item, full_of, same_bits
from tests.hf_split_scenarios import compare, load_own, run_each

BUFFER = "model.layers.1.mlp.gate.e_score_correction_bias"


@dataclass(frozen=True)
class BufferCase:
    """Load checkpoint folder ``hf`` through ``module`` on a mesh of ``sizes``, export it,
    save it with DCP under ``save_as`` and load back the checkpoint ``load_from`` (both
    folders under the root; another world size's folder is a reshard)."""

    module: str
    sizes: tuple[tuple[str, int], ...]
    hf: str = "deepseek_v3"
    save_as: str | None = None
    load_from: str | None = None
    # Also write a checkpoint with plain dcp.save (no planner: the buffer stored by DCP's
    # default path, as shardspec's saves stored buffers before they were units) and load it.
    plain: bool = False

    @property
    def label(self) -> str:
        mesh = "x".join(f"{a}{n}" for a, n in self.sizes)
        return f"{self.hf} -> {self.module} {mesh}"


def owner_state(hf_dir: str) -> dict[str, torch.Tensor]:
    """transformers' own state dict of the checkpoint: parameters and persistent buffers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fresh_model(mod: Any, mesh: Any, *, stage: bool = False, **config: Any) -> torch.nn.Module:
    """The model (its config updated by ``config``) on the meta device, cut to this rank's
    pipeline stage by ``split_stage`` (``stage``), distributed on ``mesh``, materialized
    and filled with 7.0 everywhere (parameters and buffers): what a load must overwrite."""
    with torch.device("meta"):
        model = hfm.deepseek_v3_tiny(**config)
    if stage:
        mod.split_stage(model, mesh)
    mod.distribute(model, mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            t.fill_(7.0)
    return model


def compare_state(item: Item, what: str, model: torch.nn.Module, want: dict) -> None:
    """Every entry of the model's state dict (DTensors gathered) equals ``want`` bitwise,
    and the two have the same keys."""
    got = model.state_dict(keep_vars=True)
    if set(got) != set(want):
        item.fail.append(
            f"{item.label} {what}: state dict keys differ from transformers': extra "
            f"{sorted(set(got) - set(want))}, missing {sorted(set(want) - set(got))}"
        )
    for fqn in sorted(set(got) & set(want)):
        if not same_bits(full_of(got[fqn]), want[fqn]):
            item.fail.append(f"{item.label} {what}: {fqn} differs from transformers'")
        item.checked += 1


def buffer_case(root: str, case: BufferCase, item: Item) -> None:
    mod = importlib.import_module(case.module)
    mesh = mod.build_mesh(**dict(case.sizes))
    hf_dir = os.path.join(root, case.hf)
    want = owner_state(hf_dir)
    if torch.count_nonzero(want[BUFFER]) == 0:
        item.fail.append(f"{item.label}: the checkpoint's {BUFFER} is zero (its initial value)")
    model = fresh_model(mod, mesh)
    load_own(item, mod, model, hf_dir, mesh)
    compare_state(item, "load_hf", model, want)
    world = dist.get_world_size()
    out = os.path.join(root, f"export-{world}", item.label.replace(" ", "_"))
    export_and_compare(item, mod, model, mesh, out, hf_dir)
    if case.save_as is not None:
        mod.save(model.state_dict(), os.path.join(root, case.save_as), mesh=mesh)
    if case.plain:
        import torch.distributed.checkpoint as dcp

        dcp.save(model.state_dict(), checkpoint_id=os.path.join(root, f"plain-{world}"))
    for name in [case.load_from, f"plain-{world}" if case.plain else None]:
        if name is not None:
            fresh = fresh_model(mod, mesh)
            mod.load(fresh.state_dict(), os.path.join(root, name), mesh=mesh)
            compare_state(item, f"DCP load of {name}", fresh, want)


def export_and_compare(item: Item, mod: Any, model: Any, mesh: Any, out: str, hf_dir: str) -> None:
    """``export_hf`` on every rank; rank 0 compares the export with the checkpoint
    ``hf_dir`` bitwise, and from_pretrained's logits of the two."""
    exported = mod.export_hf(model, out, mesh, config=hf_dir)
    item.extra["written"] = exported.bytes_written
    dist.barrier()
    if dist.get_rank() == 0:
        compare(item, item, out, hf_dir, logits=True)  # type: ignore[arg-type]


def run_all(rank: int, world: int, root: str, cases: list[BufferCase]) -> dict[str, Item]:
    return run_each(root, cases, buffer_case)
