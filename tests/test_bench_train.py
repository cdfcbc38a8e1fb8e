"""Smoke tests of the training-step benchmark (bench/bench_train.py) at tiny size, so
``python -m bench.bench_train`` cannot rot. The checks are on losses and collective
counts, never on times.

On 4 ranks (dp_shard 2 x tp 2) the test runs ``parallelize`` and the hand-written
baseline; the ``distribute`` variant runs on 2 ranks (dp_shard 1 x tp 2) with them: its
first step costs each rank about 15 CPU-seconds at dp_shard 2 (torch's DTensor plans the
attention's redistributions through ``_StridedShard`` placements by graph search), which
on 2 cores would make the test last over a minute.

The MoE variant (``--model moe``) runs on 4 ranks at tiny size: shardspec's side against the
hand-written torchtitan-style expert-parallel model (bench/moe_handwritten.py), with the
gradients of both checked against one process."""

from __future__ import annotations

import re

import pytest
import torch

from bench import bench_train as bt

TINY = bt.model_config(dim=64, layers=1, heads=4, kv_heads=2, vocab=256)
TINY_MOE = {**bt.MOE_MODEL, "vocab_size": 64, "dim": 32, "head_dim": 8, "moe_ffn_dim": 16}
SMALL_RUN = dict(steps=1, warmup=0, rounds=1, seq=8, batch_size=2)


def test_spec_variant_has_no_manifest_and_this_models_groups() -> None:
    text = bt.spec_text(bt.MODEL)
    assert not re.search(r"(?m)^manifest ", text)
    assert not re.search(r"(?m)^hf ", text)
    assert "fuse qkv as 2 groups of q 256, k 128, v 128" in text  # 2 q heads of 128 each
    assert "fuse qkv as 2 groups of q 32, k 16, v 16" in bt.spec_text(TINY)


def test_interleaved_w13_gives_each_tp_rank_its_gate_and_up() -> None:
    ffn, dim, tp = 6, 3, 3
    gate = torch.arange(ffn * dim, dtype=torch.float32).view(ffn, dim)
    up = -gate - 1
    w13 = torch.cat((gate, up))
    for r, shard in enumerate(bt.interleave_w13(w13, tp).chunk(tp)):
        want = torch.cat((gate.chunk(tp)[r], up.chunk(tp)[r]))
        assert torch.equal(shard, want)


def _well_formed(s: dict, variants: tuple[str, ...]) -> None:
    assert set(s) == set(variants)
    for v, x in s.items():
        assert x["median"] > 0 and len(x["round_medians"]) == 1, v
        assert x["same_on_every_rank"], v
        assert all(m >= 0 for m in x["memory"]) and all(n > 0 for n in x["state"]), v
        assert len(x["losses"]) == 1 + bt.MEMORY_STEPS + 1, v  # counting, memory, timed


@pytest.mark.dist
def test_parallelize_against_the_hand_written_one_on_4_ranks() -> None:
    variants = ("parallelize", "handwritten")
    res = bt.run(TINY, world=4, tp=2, variants=variants, **SMALL_RUN)
    s = bt.summary(res)
    _well_formed(s, variants)
    # Same model, same initial values, same batches, and the same local values on every
    # rank (the hand-written w13 rows are interleaved per TP rank): the same losses.
    assert bt.loss_gap(s, "parallelize", "handwritten") <= 1e-6
    p, h = s["parallelize"], s["handwritten"]
    layers = TINY["n_layers"]
    calls = {k: int(row["calls"]) for k, row in h["collectives"].items()}
    # torch's TP and FSDP2, counted at the dispatcher: all-gather of the root and each
    # block (again in backward), a reduce-scatter per FSDP unit, 2 TP all-reduces per block
    # forward and backward plus the embedding's and the output's input gradient, and the
    # replicated logits.
    assert calls == {
        "all_gather dp_shard": 2 * layers + 1,
        "reduce_scatter dp_shard": layers + 1,
        "all_reduce tp": 4 * layers + 2,
        "all_gather tp": 1,
    }
    # FSDP2's calls, seen by the wrapped torch.distributed functions too.
    assert h["calls"] == {"all_gather_single": 2 * layers + 1, "reduce_scatter_single": layers + 1}
    assert p["n_collectives"] <= h["n_collectives"]
    assert p["bytes"] <= h["bytes"]
    text = "\n".join(bt.report(res))
    assert "parallelize / hand-written" in text and "Target" in text and "Order:" in text


@pytest.mark.dist
def test_every_variant_trains_alike_on_2_ranks() -> None:
    res = bt.run(TINY, world=2, tp=2, **SMALL_RUN)
    s = bt.summary(res)
    _well_formed(s, bt.VARIANTS)
    assert bt.loss_gap(s, "parallelize", "handwritten") <= 1e-6
    assert bt.loss_gap(s, "parallelize", "distribute") <= 1e-5
    p, h, d = s["parallelize"], s["handwritten"], s["distribute"]
    assert p["n_collectives"] <= h["n_collectives"] and p["bytes"] <= h["bytes"]
    assert d["n_collectives"] > 0 and d["bytes"] > 0
    assert "parallelize / distribute" in "\n".join(bt.report(res))


def test_moe_spec_sizes_the_views_and_drops_the_manifest() -> None:
    text = bt.moe_spec_text(world=8, tp=4, ep=8)
    assert not re.search(r"(?m)^manifest ", text)
    assert not re.search(r"(?m)^hf ", text)
    assert "mesh dense over 8 ranks {" in text
    assert re.search(r"(?m)^    tp: 4$", text) and re.search(r"(?m)^    ep: 8$", text)
    assert "style expert_parallel" in text


def test_moe_refuses_variants_it_does_not_have() -> None:
    with pytest.raises(ValueError, match="moe variants: choose from parallelize, handwritten"):
        bt.run(TINY_MOE, kind="moe", variants=("distribute",))
    with pytest.raises(ValueError, match="kind 'gpt'"):
        bt.run(kind="gpt")


@pytest.mark.dist
@pytest.mark.parametrize("ep", [2, 4])
def test_moe_shardspec_against_the_hand_written_expert_parallel_on_4_ranks(ep: int) -> None:
    """ep 2 x efsdp 2, and ep 4 x efsdp 1 (FSDP2 over one rank: no reduce-scatter, where
    torch 2.13 divides the gradient twice if sums are forced), both with dense tp 2."""
    variants = ("parallelize", "handwritten")
    res = bt.run(TINY_MOE, world=4, tp=2, ep=ep, kind="moe", **SMALL_RUN)
    s = bt.summary(res)
    _well_formed(s, variants)
    p, h = s["parallelize"], s["handwritten"]
    # Both compute the gradients of one process on the whole batch (the experts' FSDP2
    # gradients divided by the world, the per-head norms' weights summed over tp), and the
    # same losses.
    for v in variants:
        assert s[v]["grad_gap"] is not None and s[v]["grad_gap"] <= 1e-5, v
    assert bt.loss_gap(s, "parallelize", "handwritten") <= 1e-6
    layers = TINY_MOE["n_layers"]
    calls = {k: int(row["calls"]) for k, row in h["collectives"].items()}
    # Per MoE layer: one exchange of the counts, the rows dispatched and combined forward
    # and backward; TP's all-reduces (wo's output forward; backward, the input gradient of
    # each of wq, wk and wv, and q_norm's and k_norm's weight gradients); FSDP2 over each
    # view's fsdp axis (the root, each block, each block's experts).
    want = {
        "all_to_all_counts ep": layers,
        "all_to_all ep": 4 * layers,
        "all_reduce tp": 6 * layers,
        "all_gather fsdp": 2 * layers + 1,
        "reduce_scatter fsdp": layers + 1,
    }
    if ep < 4:  # efsdp > 1
        want.update({"all_gather efsdp": 2 * layers, "reduce_scatter efsdp": layers})
    assert calls == want
    # The same collectives, in the same order, with the same buffers; the routed rows at
    # the floor (tokens x top-k x hidden x 4 bytes, both ways, forward and backward).
    assert p["sequence"] == h["sequence"]
    floor = bt.all_to_all_floor(res["options"], 4)
    assert floor == 4 * (2 // 2 * 8) * 2 * 32 * 4 * 4 * layers
    assert p["all_to_all_bytes"] == h["all_to_all_bytes"] == floor
    text = "\n".join(bt.report(res))
    assert "the floor" in text and "(1.000x)" in text and "Gradients" in text
    assert "shardspec `parallelize` on views" in text
    assert "Order: parallelize and hand-written issue the same" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "moe", "--variants", "distribute"], "choose from parallelize, handwritten"),
        (["--model", "gpt"], "invalid choice: 'gpt'"),
        (["--variants", "moe"], "choose from parallelize, handwritten, distribute"),
    ],
)
def test_command_line_refuses_what_the_model_has_not(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bt.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_moe_command_line_config() -> None:
    args = bt.argparse.Namespace(
        model="moe",
        dim=128,
        layers=None,
        heads=4,
        kv_heads=2,
        ffn=None,
        experts=16,
        top_k=4,
        vocab=None,
    )
    cfg = bt._config_from(args)
    assert cfg == {**bt.MOE_MODEL, "dim": 128, "head_dim": 32, "n_experts": 16, "top_k": 4}
