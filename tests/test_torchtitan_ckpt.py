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

import pytest

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


def compile_titan(root: Path) -> None:
    """The model's manifest (with its hooks' keys) and the spec's module, under ``root``."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "shardspec",
            "manifest",
            "examples.models.llama3_fused:titan_tiny",
            "-o",
            str(root / "manifest.json"),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    (root / "titan.shard").write_text(SPEC)
    out = compile_specs([str(root / "titan.shard")], str(root / "out"))
    assert not out.errors, out.errors


@pytest.mark.dist
def test_torchtitan_checkpoints_on_4_ranks(tmp_path: Path) -> None:
    compile_titan(tmp_path)
    results = run_ranks(torchtitan_ckpt_scenarios.run_all, 4, str(tmp_path), timeout=240)
    failures = [f"rank {r}: {msg}" for r, (fails, _) in enumerate(results) for msg in fails]
    assert not failures, "\n".join(failures[:30])
    for rank, (_, checked) in enumerate(results):
        assert checked == EXPECTED, f"rank {rank} checked {checked}"
