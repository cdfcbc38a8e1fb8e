"""Rank code for ``tests/test_hf_split.py``: transformers' own Phi3 (MHA and GQA) and GPT-2
models, used as they are, loaded from checkpoints that store fused tensors (``qkv_proj``,
``gate_up_proj``, Conv1D ``c_attn``) through split hf lines, and exported back.

The oracle is the checkpoint transformers wrote: every loaded parameter must equal its
tensor bitwise (a split line's units are its rows or columns), and the export must equal
the files bitwise. Failures are collected as strings (see ``dist_scenarios``).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from examples.models import hf as hfm
from tests.hf_scenarios import (
    Item,
    compare_export,
    count_collectives,
    full_of,
    hf_state,
    same_bits,
)


@dataclass(frozen=True)
class SplitCase:
    """Load checkpoint folder ``hf`` into transformers model ``model`` through ``module``
    on a mesh of ``sizes``; ``truth`` is the folder holding the model's own weights (the
    checkpoint itself, unless it stores them transformed)."""

    module: str
    sizes: tuple[tuple[str, int], ...]
    model: str  # phi3, phi3_mha, gpt2
    hf: str
    truth: str

    @property
    def label(self) -> str:
        mesh = "x".join(f"{a}{n}" for a, n in self.sizes)
        return f"{self.hf} -> {self.module} {mesh}"


# transformers models tie GPT-2's head to the token embedding: the spec ignores it.
TIED = {"gpt2": {"lm_head.weight": "transformer.wte.weight"}}


def factory(model: str) -> Any:
    if model == "phi3_mha":
        return hfm.phi3_tiny(num_key_value_heads=4)
    return hfm.phi3_tiny() if model == "phi3" else hfm.gpt2_tiny()


def fresh_load(
    case: Any, make: Callable[[], Any], hf_dir: str, item: Item, prepare: Callable = lambda m: None
) -> tuple[Any, Any, Any]:
    """``(module, mesh, model)``: the model ``make()`` builds on the meta device,
    distributed through ``case.module`` on a mesh of ``case.sizes``, materialized
    (``prepare`` then runs on it), its parameters filled with 7 (what the load must
    overwrite) and loaded from ``hf_dir``; a collective, or bytes read that the rank does
    not own, are failures."""
    mod = importlib.import_module(case.module)
    mesh = mod.build_mesh(**dict(case.sizes))
    with torch.device("meta"):
        model = make()
    mod.distribute(model, mesh)
    model.to_empty(device="cpu")
    prepare(model)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    load_own(item, mod, model, hf_dir, mesh)
    return mod, mesh, model


def load_own(item: Item, mod: Any, model: Any, hf_dir: str, mesh: Any) -> None:
    """``load_hf``, which must not communicate and must read exactly this rank's bytes."""
    with count_collectives() as calls:
        report = mod.load_hf(model, hf_dir, mesh)
    if calls:
        item.fail.append(f"{item.label}: load_hf communicated: {calls}")
    if report.bytes_read != report.bytes_owned:
        item.fail.append(f"{item.label}: read {report.bytes_read} for {report.bytes_owned}")


def split_case(root: str, case: SplitCase, item: Item) -> None:
    hf_dir = os.path.join(root, case.hf)
    mod, mesh, model = fresh_load(case, lambda: factory(case.model), hf_dir, item)
    truth = hf_state(os.path.join(root, case.truth))
    tied = TIED.get(case.model, {})
    for fqn, p in sorted(model.state_dict(keep_vars=True).items()):
        if fqn in tied:
            continue
        got = full_of(p)
        if fqn not in truth:
            item.fail.append(f"{item.label} {fqn}: not in transformers' checkpoint")
        elif not same_bits(got, truth[fqn]):
            item.fail.append(f"{item.label} {fqn}: loaded differs from transformers' weights")
        item.checked += 1
    out = os.path.join(root, f"export-{dist.get_world_size()}", item.label.replace(" ", "_"))
    exported = mod.export_hf(model, out, mesh, config=hf_dir)
    item.extra["written"] = exported.bytes_written
    if dist.get_rank() == 0:
        # transformers reads only checkpoints stored as it stores them (not phi3_kqv)
        logits = dist.get_world_size() == 1 and case.hf == case.truth
        compare(case, item, out, hf_dir, logits)


def compare(case: SplitCase, item: Item, out: str, hf_dir: str, logits: bool) -> None:
    """Rank 0: the export against the original files bitwise, and (``logits``)
    from_pretrained of the export against from_pretrained of the original."""
    import transformers

    compare_export(case, item, out, hf_dir)  # type: ignore[arg-type]
    if not logits:
        return
    try:
        tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
        outs = []
        for folder in (hf_dir, out):
            m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            with torch.no_grad():
                outs.append(m.eval()(tokens).logits)
        item.extra["logits equal"] = torch.equal(outs[0], outs[1])
        if not item.extra["logits equal"]:
            item.fail.append(f"{item.label}: the export's logits differ from the original's")
    except Exception:
        item.fail.append(f"{item.label}: logits check raised:\n{traceback.format_exc()}")


def run_all(rank: int, world: int, root: str, cases: list[SplitCase]) -> dict[str, Item]:
    return run_each(root, cases, split_case)


def run_each(root: str, cases: Sequence[Any], one: Callable[[str, Any, Item], None]) -> dict:
    """``one(root, case, item)`` for each case (with ``root/gen``'s compiled variants
    importable), on every rank: each case's Item by its label."""
    gen = os.path.join(root, "gen")
    if gen not in sys.path:
        sys.path.insert(0, gen)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    out: dict[str, Item] = {}
    for case in cases:
        item = Item(case.label)
        try:
            one(root, case, item)
        except Exception:
            item.fail.append(f"{item.label} raised:\n{traceback.format_exc()}")
        dist.barrier()
        out[item.label] = item
    return out
