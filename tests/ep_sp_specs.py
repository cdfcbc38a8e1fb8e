"""Specs for tests/test_ep_sp.py, written at test time from specs/deepseek_moe_folded.shard:
the example MoE without its hyper-connection head, sequence-parallel on the dense view
(torchtitan's layout: the embedding and attention's output projection leave the residual
stream cut by sequence over tp, the blocks' norms are torch's SequenceParallel, attention's
projections gather the sequence; the final norm gathers it with the caller's
``FINAL_NORM`` style, since the example MoE's head is ``F.linear`` on its weight, which no
style's hooks see), with the expert view's ep innermost, so
that an EP group is the dense view's tp group (ep borrows tp)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput

from shardspec.cli import main as shardspec_main

REPO = Path(__file__).resolve().parents[1]
MODEL_ARGS = {"hc_mult": 0}
# parallelize's `styles` for the final norm: the residual stream's sequence gathered.
FINAL_NORM = {
    "norm": PrepareModuleInput(
        input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True
    )
}

SP_EDITS = (
    ("    ep: 2\n    efsdp: *\n", "    efsdp: *\n    ep: 2\n"),
    (
        "param embed.weight [vocab, hidden] {}",
        "param embed.weight [vocab, hidden] {\n    shard vocab over tp\n"
        "    style rowwise output sequence\n}",
    ),
    (
        "    heads out head_dim\n    shard out over tp\n",
        "    heads out 16\n    shard out over tp\n    style colwise input sequence\n",
    ),
    (
        "    heads heads head_dim\n    shard heads over tp\n",
        "    heads heads 16\n    shard heads over tp\n    style rowwise output sequence\n",
    ),
    (
        "param **.*norm.weight [dim] {}",
        "param **.*norm.weight [dim] {\n    style sequence_parallel\n}\n"
        "# The final norm reads the whole sequence (the caller's PrepareModuleInput gathers\n"
        "# it): the example MoE's LM head is F.linear on the head's weight, where no style's\n"
        "# hooks run.\nparam norm.weight [dim] {}",
    ),
    ("param hc_head.* replicate\n", ""),
)
# (The example MoE's head size, 16: the hf block, which names head_dim, is left out.)
# Variants parallelize refuses: expert tensor parallelism under sequence parallelism, and
# a router cut over tp inside an MoE block whose tokens are the rank's own.
REFUSED_EDITS = {
    "moe_sp_etp": (
        ("    efsdp: *\n    ep: 2\n", "    efsdp: *\n    ep: 2\n    etp: 2\n"),
        (
            "param layers.*.moe.experts.w2 [expert, hidden, ffn] {\n    shard expert over ep\n",
            "param layers.*.moe.experts.w2 [expert, hidden, ffn] {\n    shard expert over ep\n"
            "    shard ffn over etp\n",
        ),
        (
            "param layers.*.moe.experts.w{1,3} [expert, ffn, hidden] {\n    shard expert over ep\n",
            "param layers.*.moe.experts.w{1,3} [expert, ffn, hidden] {\n"
            "    shard expert over ep\n    shard ffn over etp\n",
        ),
    ),
    "moe_sp_router_tp": (
        (
            "param layers.*.moe.router.weight [expert, hidden] {\n    view dense\n}",
            "param layers.*.moe.router.weight [expert, hidden] {\n    shard hidden over tp\n"
            "    style none\n}",
        ),
    ),
}


# specs/qwen3_moe_folded.shard made sequence-parallel the same way (transformers'
# Qwen3MoeForCausalLM calls its LM head as a module: torch's ColwiseParallel gathers there).
QWEN3_EDITS = (
    SP_EDITS[0],
    (
        "param model.embed_tokens.weight [vocab, hidden] {}",
        "param model.embed_tokens.weight [vocab, hidden] {\n    shard vocab over tp\n"
        "    style rowwise output sequence\n}",
    ),
    (
        "    heads out 16\n    shard out over tp\n",
        "    heads out 16\n    shard out over tp\n    style colwise input sequence\n",
    ),
    (
        "    heads heads 16\n    shard heads over tp\n",
        "    heads heads 16\n    shard heads over tp\n    style rowwise output sequence\n",
    ),
    (
        "param **.*norm.weight [dim] {}",
        "param **.*norm.weight [dim] {\n    style sequence_parallel\n}",
    ),
    (
        "param lm_head.weight [vocab, hidden] {}",
        "param lm_head.weight [vocab, hidden] {\n    shard vocab over tp\n"
        "    style colwise input sequence output replicate\n}",
    ),
)


def sp_text(manifest: str) -> str:
    """specs/deepseek_moe_folded.shard made sequence-parallel with ep innermost."""
    text = (REPO / "specs" / "deepseek_moe_folded.shard").read_text(encoding="utf-8")
    text = text.replace('"deepseek_moe.manifest.json"', json.dumps(manifest))
    return edited(re.sub(r'(?ms)^hf "[^"]*" \{.*?^\}\n?', "", text), SP_EDITS, "the spec")


def edited(text: str, edits: tuple[tuple[str, str], ...], what: str) -> str:
    """``text`` with each ``(old, new)`` of ``edits`` made; each ``old`` occurs once."""
    for old, new in edits:
        assert text.count(old) == 1, f"{what} changed: {old!r}"
        text = text.replace(old, new)
    return text


def compile_all(gen: Path) -> None:
    """moe_sp, qwen3_moe_sp and moe_folded_nohc (lint clean, compiled) and REFUSED_EDITS'
    variants (compiled) into ``gen``."""
    gen.mkdir(parents=True, exist_ok=True)
    manifest = str(gen / "moe_sp.manifest.json")
    args = [f"--arg={k}={v}" for k, v in MODEL_ARGS.items()]
    assert shardspec_main(["manifest", "examples.models.moe:tiny", *args, "-o", manifest]) == 0
    base = sp_text(manifest)
    variants = {"moe_sp": base}
    qwen3 = (REPO / "specs" / "qwen3_moe_folded.shard").read_text(encoding="utf-8")
    qwen3 = qwen3.replace(
        '"qwen3_moe_folded.manifest.json"',
        json.dumps(str(REPO / "specs" / "qwen3_moe_folded.manifest.json")),
    )
    variants["qwen3_moe_sp"] = edited(qwen3, QWEN3_EDITS, "specs/qwen3_moe_folded.shard")
    variants.update((name, edited(base, e, name)) for name, e in REFUSED_EDITS.items())
    # The same model on specs/deepseek_moe_folded.shard's own fold (ep outermost, no
    # sequence parallelism): where the checkpoint scenario loads what moe_sp saved.
    folded = (REPO / "specs" / "deepseek_moe_folded.shard").read_text(encoding="utf-8")
    folded = folded.replace('"deepseek_moe.manifest.json"', json.dumps(manifest))
    folded = re.sub(r'(?ms)^hf "[^"]*" \{.*?^\}\n?', "", folded)
    heads = (
        ("    heads out head_dim\n", "    heads out 16\n"),
        ("    heads heads head_dim\n", "    heads heads 16\n"),
    )
    variants["moe_folded_nohc"] = edited(folded, (*heads, SP_EDITS[-1]), "the folded spec")
    for name, text in variants.items():
        path = gen / f"{name}.shard"
        path.write_text(text, encoding="utf-8")
        if name in ("moe_sp", "qwen3_moe_sp", "moe_folded_nohc"):
            assert shardspec_main(["lint", str(path)]) == 0, name
        assert shardspec_main(["compile", str(path), "-o", str(gen)]) == 0, name
