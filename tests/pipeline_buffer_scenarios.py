"""Rank code for ``tests/test_pipeline_buffers.py``: transformers' own DeepseekV3ForCausalLM
(4 layers; layers 1-3 route with the persistent buffer ``mlp.gate.e_score_correction_bias``,
which the checkpoint stores too), cut into pipeline stages by ``split_stage``.

The oracle is the model's owner: ``from_pretrained`` of the checkpoint in one process gives
transformers' own state dict, parameters *and* buffers. Each rank's stage model must hold
exactly its stage's parameters and buffers (under stage-local layer numbers: the spec
splits ``model.layers.{layer} local``, a ModuleList), and after ``load_hf`` (or a DCP
``load``) every entry must equal the owner's under its global name, bitwise. The stages'
``export_hf`` must write every key of the original checkpoint, bitwise, and
``from_pretrained`` of it must give the original's logits. A DCP checkpoint written at one
pipeline size must load at others. Failures are collected as strings (see
``hf_split_scenarios.run_each``).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tests.hf_buffer_scenarios import export_and_compare, fresh_model, owner_state
from tests.hf_scenarios import Item, full_of, same_bits
from tests.hf_split_scenarios import load_own, run_each

N_LAYERS = 4
HF = "deepseek_v3_4"  # the checkpoint's folder under the root
BUFFER = "model.layers.{}.mlp.gate.e_score_correction_bias"


@dataclass(frozen=True)
class StageCase:
    """Stage models of ``module`` at pipeline size ``pp`` (dp_shard: the rest of the
    ranks): ``load_hf`` the checkpoint and export it, or load the DCP checkpoint
    ``load_from``; then save one as ``save_as`` (folders under the root)."""

    module: str
    pp: int
    hf: bool = False
    load_from: str | None = None
    save_as: str | None = None

    @property
    def label(self) -> str:
        how = "load_hf+export" if self.hf else f"load {self.load_from}"
        return f"{self.module} pp{self.pp} {how}"


def compare_stage(
    item: Item, what: str, mod: Any, mesh: Any, model: torch.nn.Module, want: dict
) -> None:
    """The stage model holds exactly its stage's parameters and buffers, each (gathered)
    equal to the owner's entry of its global name."""
    sp = mod.SPEC.stage_plan(mesh)
    stage = mod.stage_of(mesh)
    got = model.state_dict(keep_vars=True)
    names = {k: sp.global_name(k, stage) for k in got}
    expected = set(sp.stored_of(stage))
    if set(names.values()) != expected:
        item.fail.append(
            f"{item.label} {what}: stage {stage} holds {sorted(set(names.values()) ^ expected)} "
            "unlike its stage's entries"
        )
    buffers = [BUFFER.format(i) for i in range(1, N_LAYERS)]
    mine = sorted(b for b in buffers if b in expected)
    item.extra.setdefault("buffers", {})[stage] = mine
    for key, fqn in sorted(names.items()):
        if fqn is None or fqn not in want:
            item.fail.append(f"{item.label} {what}: {key} is no entry of the owner's model")
            continue
        if not same_bits(full_of(got[key]), want[fqn]):
            item.fail.append(f"{item.label} {what}: {key} (= {fqn}) differs from transformers'")
        item.checked += 1


def stage_case(root: str, case: StageCase, item: Item) -> None:
    mod = importlib.import_module(case.module)
    mesh = mod.build_mesh(pp=case.pp)
    hf_dir = os.path.join(root, HF)
    want = owner_state(hf_dir)
    model = fresh_model(mod, mesh, stage=True, num_hidden_layers=N_LAYERS)
    if case.hf:
        load_own(item, mod, model, hf_dir, mesh)
        compare_stage(item, "load_hf", mod, mesh, model, want)
        out = os.path.join(root, f"export-{case.module}-pp{case.pp}")
        export_and_compare(item, mod, model, mesh, out, hf_dir)
    if case.load_from is not None:
        mod.load(model.state_dict(), os.path.join(root, case.load_from), mesh=mesh)
        compare_stage(item, f"DCP load of {case.load_from}", mod, mesh, model, want)
    if case.save_as is not None:
        path = os.path.join(root, case.save_as)
        mod.save(model.state_dict(), path, mesh=mesh)
        if dist.get_rank() == 0:
            import torch.distributed.checkpoint as dcp

            keys = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
            missing = [BUFFER.format(i) for i in range(1, N_LAYERS) if BUFFER.format(i) not in keys]
            if missing:
                item.fail.append(f"{item.label}: {path} stores no {missing} (global names)")


def run_all(rank: int, world: int, root: str, cases: list[StageCase]) -> dict[str, Item]:
    return run_each(root, cases, stage_case)
