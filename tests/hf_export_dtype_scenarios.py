"""Rank code for ``tests/test_hf_export_dtype.py``: transformers' own DeepseekV3ForCausalLM
(``examples/models/hf.py:deepseek_v3_tiny``), loaded from its fp32 checkpoint through
``specs/deepseek_v3.shard`` and exported in bf16, compared with transformers' own bf16
saves of the same weights (the model's owner is the oracle): key for key, dtype for dtype,
bit for bit. Failures are collected as strings (see ``dist_scenarios``)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

from tests.hf_buffer_scenarios import fresh_model
from tests.hf_scenarios import hf_state, same_bits
from tests.hf_split_scenarios import run_each

# (export folder, keep_dtype, transformers' reference folder), under the root.
EXPORTS = (
    ("bf16", (), "to-bf16"),  # model.to(torch.bfloat16).save_pretrained
    ("bf16-keep", None, "from-bf16"),  # from_pretrained(dtype=torch.bfloat16).save_pretrained
)


def run(rank: int, world: int, root: str, keep: list[str]) -> dict[str, Any]:
    return run_each(root, [_Case(keep)], _export_and_compare)


class _Case:
    label = "deepseek_v3 bf16 export"

    def __init__(self, keep: list[str]) -> None:
        self.keep = keep


def _export_and_compare(root: str, case: _Case, item: Any) -> None:
    import generated.deepseek_v3 as mod

    world = dist.get_world_size()
    mesh = mod.build_mesh(dp_shard=world, ep=1)
    model = fresh_model(mod, mesh)
    mod.load_hf(model, os.path.join(root, "deepseek_v3"), mesh)
    for name, keep, ref in EXPORTS:
        out = os.path.join(root, name)
        report = mod.export_hf(
            model, out, mesh, dtype=torch.bfloat16, keep_dtype=case.keep if keep is None else ()
        )
        item.extra[f"{name} file"] = report.file
        dist.barrier()
        if dist.get_rank() == 0:
            compare_dtypes(item, out, os.path.join(root, ref))


def compare_dtypes(item: Any, out: str, ref: str) -> None:
    """The export at ``out`` against transformers' save at ``ref``: the same keys, each in
    the same dtype with the same bits, and an index whose total size is the files'."""
    got, want = hf_state(out), hf_state(ref)
    if got.keys() != want.keys():
        item.fail.append(
            f"{out}: keys differ from {ref}'s: extra {sorted(got.keys() - want.keys())}, "
            f"missing {sorted(want.keys() - got.keys())}"
        )
    for key in sorted(got.keys() & want.keys()):
        item.checked += 1
        if got[key].dtype != want[key].dtype:
            item.fail.append(
                f"{out}: {key} is {got[key].dtype}, transformers wrote {want[key].dtype}"
            )
        elif not same_bits(got[key], want[key]):
            item.fail.append(f"{out}: {key} differs from transformers' bits")
    with open(os.path.join(out, "model.safetensors.index.json"), encoding="utf-8") as f:
        total = json.load(f)["metadata"]["total_size"]
    size = sum(t.numel() * t.element_size() for t in got.values())
    if total != size:
        item.fail.append(f"{out}: the index's total_size {total} is not the tensors' {size}")
    item.extra[f"{os.path.basename(out)} dtypes"] = sorted(
        {(k, str(t.dtype)) for k, t in got.items() if t.dtype != torch.bfloat16}
    )
