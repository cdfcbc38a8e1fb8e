"""Checkpoints exchanged with torchtitan's checkpointer (``keys="torchtitan"``), on 4 gloo
ranks: torchtitan's checkpoint of a fused-QKV Llama 3 at dp_shard 4 loads into the spec's
model at tp 2 x dp_shard 2, and the spec's checkpoint loads the torchtitan way, each
bitwise against the tensors torch gathers whole (scenarios, and what torchtitan writes, in
``tests/torchtitan_ckpt_scenarios.py``). ``save`` runs its crash-proof protocol unchanged
with a key layout (only the stored names differ), so the kill-point tests of
``tests/test_ckpt_crash.py`` cover it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shardspec.api import compile_specs
from shardspec.testing import run_ranks
from tests import torchtitan_ckpt_scenarios

ROOT = Path(__file__).resolve().parent.parent

SPEC = """\
# torchtitan's Llama 3 with fuse_qkv=True (examples/models/llama3_fused.py:titan_tiny):
# wqkv rows grouped per kv head, which its state-dict hooks present as wq/wk/wv.
manifest "manifest.json"

mesh over 4 ranks {
    dp_shard: *
    tp: 2
}

fsdp dp_shard

param tok_embeddings.weight [vocab, hidden] {
    shard vocab over tp
    shard hidden over dp_shard
}
param layers.*.attention.qkv_linear.wqkv.weight [qkv, hidden] {
    fuse qkv as 2 groups of q 32, k 16, v 16
    heads qkv 16
    shard qkv over tp
    shard hidden over dp_shard
}
param layers.*.attention.wo.weight [hidden, heads] {
    shard heads over tp
    shard hidden over dp_shard
}
param layers.*.feed_forward.w13.weight [ffn, hidden] {
    fuse ffn as gate, up
    shard hidden over dp_shard
}
param layers.*.feed_forward.w2.weight [hidden, ffn] {
    shard hidden over dp_shard
}
param **.*norm.weight [hidden] {}
param output.weight [vocab, hidden] {
    shard vocab over tp
    shard hidden over dp_shard
    style colwise output replicate
}
"""

EXPECTED = {"[torchtitan->shardspec]": 1, "[shardspec->torchtitan]": 2, "[hooked]": 1}


def write_manifest(root: Path, factory: str) -> None:
    """``root/manifest.json``: ``shardspec manifest`` of ``factory`` (with its hooks' keys)."""
    subprocess.run(
        [sys.executable, "-m", "shardspec", "manifest", factory, "-o", str(root / "manifest.json")],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )


def compile_titan(root: Path) -> None:
    """The model's manifest (with its hooks' keys) and the spec's module, under ``root``."""
    write_manifest(root, "examples.models.llama3_fused:titan_tiny")
    (root / "titan.shard").write_text(SPEC)
    out = compile_specs([str(root / "titan.shard")], str(root / "out"))
    assert not out.errors, out.errors


def assert_ranks(run_all: Any, root: Path, expected: dict[str, int], timeout: int) -> None:
    """Run ``run_all`` (failures, checked counts per rank) on 4 ranks: no failure, and
    every rank checked ``expected``."""
    results = run_ranks(run_all, 4, str(root), timeout=timeout)
    failures = [f"rank {r}: {msg}" for r, (fails, _) in enumerate(results) for msg in fails]
    assert not failures, "\n".join(failures[:30])
    for rank, (_, checked) in enumerate(results):
        assert checked == expected, f"rank {rank} checked {checked}"


@pytest.mark.dist
def test_torchtitan_checkpoints_on_4_ranks(tmp_path: Path) -> None:
    compile_titan(tmp_path)
    assert_ranks(torchtitan_ckpt_scenarios.run_all, tmp_path, EXPECTED, timeout=240)


def test_titan_tiny_is_the_grouped_llama_with_torchtitans_hooks() -> None:
    """The stand-in for torchtitan's model computes what examples.models.llama (group-major
    ``wqkv``, the same rows) computes from the same weights, bitwise, and its hooks present
    exactly llama's ``split_wqkv`` of that tensor under torchtitan's keys, and join them
    back (one process)."""
    from examples.models import llama, llama3_fused

    ours, ref = llama3_fused.titan_tiny(), llama.tiny()
    llama.init_weights(ref, 3)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(params[name.replace("qkv_linear.", "")])
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(ours(tokens), ref(tokens))
    sd = ours.state_dict()
    assert not any("wqkv" in k for k in sd)
    for i in range(ref.config.n_layers):
        parts = llama.split_wqkv(params[f"layers.{i}.attention.wqkv.weight"], ref.config)
        for name, want in zip(("wq", "wk", "wv"), parts, strict=True):
            assert torch.equal(sd[f"layers.{i}.attention.qkv_linear.{name}.weight"], want)
    back = llama3_fused.titan_tiny()
    back.load_state_dict(sd)
    assert torch.equal(back(tokens), ref(tokens))
