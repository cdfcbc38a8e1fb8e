"""Rank code for ``tests/test_hf_grouped.py``: transformers' own GptOssForCausalLM, used as
it is, loaded from the checkpoint transformers wrote (stacked experts whose
``gate_up_proj`` interleaves gate and up) through ``specs/gpt_oss.shard`` and variants, and
exported back.

The oracle is the model's owner: ``from_pretrained`` of the same checkpoint. Every
parameter and every buffer of the loaded model (non-persistent RoPE buffers recomputed as
the README says) must equal the owner's bitwise; the export must equal the original files
bitwise, and ``from_pretrained`` of the export must give the original's logits. Failures
are collected as strings (see ``dist_scenarios``); each case also reports which tensors
differ from the owner's, so the test can show that a wrong spec is caught.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from examples.models import hf as hfm
from tests.hf_scenarios import Item, full_of, same_bits
from tests.hf_split_scenarios import compare, fresh_load, run_each


@dataclass(frozen=True)
class GroupedCase:
    """Load the checkpoint folder ``hf`` into GptOss through ``module`` on a mesh of
    ``sizes``."""

    module: str
    sizes: tuple[tuple[str, int], ...]
    hf: str = "gpt_oss"

    @property
    def label(self) -> str:
        mesh = "x".join(f"{a}{n}" for a, n in self.sizes)
        return f"{self.hf} -> {self.module} {mesh}"


def owner(hf_dir: str) -> Any:
    """The model as its owner loads the checkpoint."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)


def recompute_rope(model: Any) -> None:
    """The non-persistent RoPE buffers, garbage after ``to_empty``, computed as the module
    computes them (README, "Meta-device initialization")."""
    rope = model.model.rotary_emb
    inv_freq, _ = rope.compute_default_rope_parameters(rope.config, device="cpu")
    with torch.no_grad():
        rope.inv_freq.copy_(inv_freq)
        rope.original_inv_freq.copy_(inv_freq)


def grouped_case(root: str, case: GroupedCase, item: Item) -> None:
    hf_dir = os.path.join(root, case.hf)
    mod, mesh, model = fresh_load(case, hfm.gpt_oss_tiny, hf_dir, item, recompute_rope)
    want = owner(hf_dir)
    theirs = {**dict(want.named_parameters()), **dict(want.named_buffers())}
    ours = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    if set(ours) != set(theirs):
        item.fail.append(f"{item.label}: tensors {sorted(set(ours) ^ set(theirs))} not in both")
    differ = []
    for name in sorted(set(ours) & set(theirs)):
        if not same_bits(full_of(ours[name]), theirs[name].detach()):
            differ.append(name)
        item.checked += 1
    item.extra["differ"] = differ
    out = os.path.join(root, f"export-{dist.get_world_size()}", item.label.replace(" ", "_"))
    exported = mod.export_hf(model, out, mesh, config=hf_dir)
    item.extra["written"] = exported.bytes_written
    if dist.get_rank() == 0:
        compare(case, item, out, hf_dir, logits=True)  # type: ignore[arg-type]


def run_all(rank: int, world: int, root: str, cases: list[GroupedCase]) -> dict[str, Item]:
    return run_each(root, cases, grouped_case)
