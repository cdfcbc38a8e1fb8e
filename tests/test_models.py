"""Tests for the reference models in ``examples/models`` (CPU, tiny shapes, no downloads)."""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from examples.models import hf as hfm
from examples.models import llama, moe

Shapes = dict[str, tuple[int, ...]]


# ----------------------------------------------------------------------------- expected FQNs


def llama_shapes(cfg: llama.LlamaConfig) -> Shapes:
    """The parameter FQNs and shapes that the Llama spec promises."""
    d, hd, f = cfg.dim, cfg.head_dim, cfg.ffn_dim
    qkv = cfg.n_kv_heads * (cfg.n_heads // cfg.n_kv_heads + 2) * hd
    shapes: Shapes = {"tok_embeddings.weight": (cfg.vocab_size, d), "norm.weight": (d,)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        shapes[p + "attention_norm.weight"] = (d,)
        shapes[p + "attention.wqkv.weight"] = (qkv, d)
        shapes[p + "attention.wo.weight"] = (d, cfg.n_heads * hd)
        shapes[p + "ffn_norm.weight"] = (d,)
        shapes[p + "feed_forward.w13.weight"] = (2 * f, d)
        shapes[p + "feed_forward.w2.weight"] = (d, f)
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (cfg.vocab_size, d)
    return shapes


def moe_shapes(cfg: moe.MoEConfig) -> Shapes:
    """The parameter FQNs and shapes that the MoE spec promises."""
    d, hd, f, e = cfg.dim, cfg.head_dim, cfg.moe_ffn_dim, cfg.n_experts
    shapes: Shapes = {"embed.weight": (cfg.vocab_size, d), "norm.weight": (d,)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        shapes[p + "attn_norm.weight"] = (d,)
        shapes[p + "attn.wq.weight"] = (cfg.n_heads * hd, d)
        shapes[p + "attn.wk.weight"] = (cfg.n_kv_heads * hd, d)
        shapes[p + "attn.wv.weight"] = (cfg.n_kv_heads * hd, d)
        shapes[p + "attn.wo.weight"] = (d, cfg.n_heads * hd)
        shapes[p + "attn.q_norm.weight"] = (hd,)
        shapes[p + "attn.k_norm.weight"] = (hd,)
        shapes[p + "ffn_norm.weight"] = (d,)
        shapes[p + "moe.router.weight"] = (e, d)
        if cfg.local_experts:
            for j in range(e // cfg.ep):
                q = f"{p}moe.local_experts.{j}."
                shapes[q + "w1.weight"] = (f, d)
                shapes[q + "w3.weight"] = (f, d)
                shapes[q + "w2.weight"] = (d, f)
        else:
            shapes[p + "moe.experts.w1"] = (e, f, d)
            shapes[p + "moe.experts.w3"] = (e, f, d)
            shapes[p + "moe.experts.w2"] = (e, d, f)
    if cfg.hc_mult > 0:
        h = cfg.hc_mult
        shapes.update({"hc_head.fn": (h, h * d), "hc_head.base": (h,), "hc_head.scale": (1,)})
    if not cfg.tie_embeddings:
        shapes["head.weight"] = (cfg.vocab_size, d)
    return shapes


FACTORIES: list[tuple[str, Callable[..., nn.Module], Callable[..., Shapes]]] = [
    ("llama.tiny", llama.tiny, llama_shapes),
    ("llama.tiny_tied", llama.tiny_tied, llama_shapes),
    ("moe.tiny", moe.tiny, moe_shapes),
    ("moe.tiny_local", moe.tiny_local, moe_shapes),
    ("moe.tiny_qwen3", moe.tiny_qwen3, moe_shapes),
]


def param_shapes(model: nn.Module) -> Shapes:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


# ------------------------------------------------------------------------- build on meta


@pytest.mark.parametrize(("name", "factory", "expected"), FACTORIES, ids=[f[0] for f in FACTORIES])
def test_factory_builds_on_meta_with_the_promised_fqns(
    name: str, factory: Callable[..., nn.Module], expected: Callable[..., Shapes]
) -> None:
    params = inspect.signature(factory).parameters.values()
    assert all(
        p.kind is p.VAR_KEYWORD or (p.kind is p.KEYWORD_ONLY and p.default is not p.empty)
        for p in params
    ), f"{name} must take only keyword arguments with defaults"

    with torch.device("meta"):
        model = factory()
    assert all(p.device.type == "meta" for p in model.parameters())
    assert param_shapes(model) == expected(model.config)
    assert not list(model.buffers())  # nothing outside the parameters (and extra state)


def test_llama_fqns_spot_checks() -> None:
    with torch.device("meta"):
        model, tied = llama.tiny(), llama.tiny_tied()
    shapes = param_shapes(model)
    assert shapes["layers.1.attention.wqkv.weight"] == (2 * (2 + 2) * 16, 64)
    assert shapes["layers.0.feed_forward.w13.weight"] == (192, 64)
    assert shapes["layers.0.feed_forward.w2.weight"] == (64, 96)
    assert shapes["output.weight"] == (256, 64)
    assert "output.weight" not in param_shapes(tied)
    assert len(shapes) == 2 + 6 * 2 + 1


def test_moe_fqns_spot_checks() -> None:
    with torch.device("meta"):
        stacked, local, qwen3 = moe.tiny(), moe.tiny_local(), moe.tiny_qwen3(tie_embeddings=True)
    shapes = param_shapes(stacked)
    assert shapes["layers.1.moe.experts.w1"] == (8, 32, 64)
    assert shapes["layers.1.moe.experts.w2"] == (8, 64, 32)
    assert shapes["layers.0.attn.q_norm.weight"] == (16,)
    assert shapes["hc_head.fn"] == (2, 128)
    local_shapes = param_shapes(local)
    assert local_shapes["layers.0.moe.local_experts.3.w2.weight"] == (64, 32)
    assert "layers.0.moe.local_experts.4.w1.weight" not in local_shapes  # ep=2: 4 per rank
    assert not any(".experts." in k for k in local_shapes)
    qwen3_shapes = param_shapes(qwen3)
    assert not any(k.startswith(("hc_head.", "head.")) for k in qwen3_shapes)
    # TransformerEngine-style extra state is in the state dict but is no parameter.
    state = stacked.state_dict()
    assert {k for k in state if k not in shapes} == {
        f"layers.{i}.attn.fp8_meta._extra_state" for i in range(2)
    }


def test_init_weights_is_deterministic() -> None:
    a, b, c = llama.tiny(), llama.tiny(), llama.tiny()
    llama.init_weights(a, seed=3)
    llama.init_weights(b, seed=3)
    llama.init_weights(c, seed=4)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name
        if name.endswith("norm.weight"):
            assert (pa - 1).abs().max() < 0.5
        else:
            assert pa.std() < 0.05
    m = moe.tiny()
    moe.init_weights(m, seed=0)
    assert all(torch.isfinite(p).all() for p in m.parameters())
    with torch.device("meta"):
        meta_model = moe.tiny()
    with pytest.raises(ValueError, match="meta"):
        moe.init_weights(meta_model, seed=0)


@pytest.mark.parametrize("factory", [llama.tiny, llama.tiny_tied, moe.tiny, moe.tiny_qwen3])
def test_forward_runs_on_meta(factory: Callable[..., nn.Module]) -> None:
    with torch.device("meta"):
        model = factory()
        logits = model(torch.zeros(2, 5, dtype=torch.long))
    assert logits.shape == (2, 5, model.config.vocab_size)


# --------------------------------------------------------------------------------- llama


def test_split_fuse_wqkv_round_trip_and_layout() -> None:
    cfg = llama.LlamaConfig(n_heads=6, n_kv_heads=2)  # 3 q heads per group
    hd, qpg = cfg.head_dim, cfg.q_per_group
    wqkv = torch.randn(cfg.qkv_dim, cfg.dim)
    wq, wk, wv = llama.split_wqkv(wqkv, cfg)
    assert wq.shape == (cfg.n_heads * hd, cfg.dim)
    assert wk.shape == wv.shape == (cfg.n_kv_heads * hd, cfg.dim)
    assert torch.equal(llama.fuse_wqkv(wq, wk, wv, cfg), wqkv)

    # The layout, spelled out: group g = q heads g*qpg .. (g+1)*qpg-1, then k head g, v head g.
    rows = (qpg + 2) * hd
    for g in range(cfg.n_kv_heads):
        group = wqkv[g * rows : (g + 1) * rows]
        assert torch.equal(group[: qpg * hd], wq[g * qpg * hd : (g + 1) * qpg * hd])
        assert torch.equal(group[qpg * hd : (qpg + 1) * hd], wk[g * hd : (g + 1) * hd])
        assert torch.equal(group[(qpg + 1) * hd :], wv[g * hd : (g + 1) * hd])

    q, k, v = torch.randn_like(wq), torch.randn_like(wk), torch.randn_like(wv)
    for a, b in zip(llama.split_wqkv(llama.fuse_wqkv(q, k, v, cfg), cfg), (q, k, v), strict=True):
        assert torch.equal(a, b)
    # A TP-local shard of whole groups splits into that shard's heads.
    lq, lk, lv = llama.split_wqkv(wqkv[rows:], cfg)
    assert torch.equal(lq, wq[qpg * hd :]) and torch.equal(lk, wk[hd:]) and torch.equal(lv, wv[hd:])


def reference_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """torchtitan's precompute_freqs_cis + apply_rotary_emb, for x [B, T, H, hd]."""
    seq_len, hd = x.shape[1], x.shape[-1]
    freqs = 1.0 / (theta ** (torch.arange(0, hd, 2)[: hd // 2].float() / hd))
    freqs_cis = torch.polar(torch.ones(seq_len, hd // 2), torch.outer(torch.arange(seq_len), freqs))
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3).type_as(x)


def reference_attention(
    x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, hd: int
) -> torch.Tensor:
    """Causal GQA attention from separate q/k/v weights, written out by hand."""
    bsz, seq_len, _ = x.shape
    q = reference_rope((x @ wq.T).view(bsz, seq_len, -1, hd), 10000.0)
    k = reference_rope((x @ wk.T).view(bsz, seq_len, -1, hd), 10000.0)
    v = (x @ wv.T).view(bsz, seq_len, -1, hd)
    n_heads, n_kv = q.shape[2], k.shape[2]
    kv_of_head = [h // (n_heads // n_kv) for h in range(n_heads)]
    k, v = k[:, :, kv_of_head], v[:, :, kv_of_head]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out.flatten(2) @ wo.T


def test_llama_fused_attention_matches_separate_qkv() -> None:
    cfg = llama.LlamaConfig(n_heads=6, n_kv_heads=2)
    attn = llama.Attention(cfg)
    llama.init_weights(attn, seed=1, std=0.2)
    x = torch.randn(2, 7, cfg.dim)
    cos, sin = llama.rope_cos_sin(7, cfg.head_dim, cfg.rope_theta)
    wq, wk, wv = llama.split_wqkv(attn.wqkv.weight.detach(), cfg)
    with torch.no_grad():
        expected = reference_attention(x, wq, wk, wv, attn.wo.weight, cfg.head_dim)
        torch.testing.assert_close(attn(x, cos, sin), expected, atol=1e-5, rtol=1e-5)


def test_llama_tp_local_modules_run_and_sum_to_the_full_output() -> None:
    cfg = llama.LlamaConfig()
    model = llama.tiny()
    llama.init_weights(model, seed=2, std=0.1)
    block = model.layers["0"]
    x = torch.randn(2, 5, cfg.dim)
    cos, sin = llama.rope_cos_sin(5, cfg.head_dim, cfg.rope_theta)
    tp = 2
    groups, heads, ffn = cfg.n_kv_heads // tp, cfg.n_heads // tp, cfg.ffn_dim // tp
    rows, cols = groups * cfg.group_rows, heads * cfg.head_dim
    with torch.no_grad():
        full_attn = block.attention(x, cos, sin)
        full_ffn = block.feed_forward(x)
        gate, up = block.feed_forward.w13.weight.chunk(2)
        attn_sum, ffn_sum = torch.zeros_like(x), torch.zeros_like(x)
        for r in range(tp):
            local = copy.deepcopy(block)
            a, f = local.attention, local.feed_forward
            a.wqkv.weight = nn.Parameter(a.wqkv.weight[r * rows : (r + 1) * rows].clone())
            a.wo.weight = nn.Parameter(a.wo.weight[:, r * cols : (r + 1) * cols].clone())
            shard = slice(r * ffn, (r + 1) * ffn)
            f.w13.weight = nn.Parameter(torch.cat((gate[shard], up[shard])))
            f.w2.weight = nn.Parameter(f.w2.weight[:, shard].clone())
            attn_sum += a(x, cos, sin)
            ffn_sum += f(x)
            assert local(x, cos, sin).shape == x.shape
    torch.testing.assert_close(attn_sum, full_attn, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ffn_sum, full_ffn, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_llama_matches_transformers_llama_after_the_meta_to_hf_permutation(tied: bool) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = llama.LlamaConfig(tie_embeddings=tied)
    ours = llama.Llama(cfg).eval()
    llama.init_weights(ours, seed=5, std=0.1)
    # The configs and the RoPE permutation of examples/models/hf.py, which the HF
    # load/export tests use as their oracle: checked here against transformers' logits.
    hf_cfg = hfm.llama_config(cfg)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    s = ours.state_dict()
    state = {"model.embed_tokens.weight": s["tok_embeddings.weight"]}
    state["model.norm.weight"] = s["norm.weight"]
    state["lm_head.weight"] = s["tok_embeddings.weight" if tied else "output.weight"]
    for i in range(cfg.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        wq, wk, wv = llama.split_wqkv(s[p + "attention.wqkv.weight"], cfg)
        gate, up = s[p + "feed_forward.w13.weight"].chunk(2)
        state |= {
            q + "input_layernorm.weight": s[p + "attention_norm.weight"],
            q + "self_attn.q_proj.weight": hfm.meta_rope_to_hf(wq, cfg.head_dim),
            q + "self_attn.k_proj.weight": hfm.meta_rope_to_hf(wk, cfg.head_dim),
            q + "self_attn.v_proj.weight": wv,
            q + "self_attn.o_proj.weight": s[p + "attention.wo.weight"],
            q + "post_attention_layernorm.weight": s[p + "ffn_norm.weight"],
            q + "mlp.gate_proj.weight": gate,
            q + "mlp.up_proj.weight": up,
            q + "mlp.down_proj.weight": s[p + "feed_forward.w2.weight"],
        }
    hf.load_state_dict(state, strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------- moe


def to_hf_qwen3_moe_state(
    ours: dict[str, torch.Tensor], cfg: moe.MoEConfig, hf_keys: set[str]
) -> dict[str, torch.Tensor]:
    """Map a stacked MoE state dict onto Qwen3MoeForCausalLM's keys (either expert layout)."""
    state = {
        "model.embed_tokens.weight": ours["embed.weight"],
        "model.norm.weight": ours["norm.weight"],
    }
    state["lm_head.weight"] = ours["embed.weight" if cfg.tie_embeddings else "head.weight"]
    for i in range(cfg.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        state |= {
            q + "input_layernorm.weight": ours[p + "attn_norm.weight"],
            q + "self_attn.q_proj.weight": ours[p + "attn.wq.weight"],
            q + "self_attn.k_proj.weight": ours[p + "attn.wk.weight"],
            q + "self_attn.v_proj.weight": ours[p + "attn.wv.weight"],
            q + "self_attn.o_proj.weight": ours[p + "attn.wo.weight"],
            q + "self_attn.q_norm.weight": ours[p + "attn.q_norm.weight"],
            q + "self_attn.k_norm.weight": ours[p + "attn.k_norm.weight"],
            q + "post_attention_layernorm.weight": ours[p + "ffn_norm.weight"],
            q + "mlp.gate.weight": ours[p + "moe.router.weight"],
        }
        w1, w3, w2 = (ours[f"{p}moe.experts.{n}"] for n in ("w1", "w3", "w2"))
        if q + "mlp.experts.gate_up_proj" in hf_keys:  # transformers >= 5: fused, gate rows first
            state[q + "mlp.experts.gate_up_proj"] = torch.cat((w1, w3), dim=1)
            state[q + "mlp.experts.down_proj"] = w2
        else:  # transformers 4.x: one module per expert
            for e in range(cfg.n_experts):
                state[f"{q}mlp.experts.{e}.gate_proj.weight"] = w1[e]
                state[f"{q}mlp.experts.{e}.up_proj.weight"] = w3[e]
                state[f"{q}mlp.experts.{e}.down_proj.weight"] = w2[e]
    return state


@pytest.mark.parametrize(("tied", "norm_topk_prob"), [(False, True), (True, True), (False, False)])
def test_moe_matches_transformers_qwen3_moe(tied: bool, norm_topk_prob: bool) -> None:
    transformers = pytest.importorskip("transformers")
    ours = moe.tiny_qwen3(tie_embeddings=tied, norm_topk_prob=norm_topk_prob).eval()
    cfg = ours.config
    moe.init_weights(ours, seed=7, std=0.1)
    hf = transformers.Qwen3MoeForCausalLM(hfm.qwen3_moe_config(cfg)).eval()
    hf_keys = set(hf.state_dict())
    state = to_hf_qwen3_moe_state(ours.state_dict(), cfg, hf_keys)
    assert set(state) == hf_keys
    hf.load_state_dict(state, strict=True)

    tokens = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = ours(tokens)
        torch.testing.assert_close(logits, hf(tokens).logits, atol=1e-5, rtol=0)
    assert logits.dtype == torch.float32 and logits.abs().max() > 1e-2  # not trivially zero


def _skewed_routing(
    n: int, k: int, n_experts: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """top-k indices [n, k] over experts 0, 1, 3 and 5 only (2, 4, 6, 7 get nothing), some
    slots ``n_experts`` (transformers' "no expert"), and weights [n, k]."""
    used = torch.tensor([0, 1, 3, 5])
    picks = [used[torch.randperm(4, generator=gen)[:k]] for _ in range(n)]
    index = torch.stack(picks) if picks else torch.zeros(0, k, dtype=torch.int64)
    index[::3, -1] = n_experts
    return index, torch.rand(n, k, generator=gen)


@pytest.mark.parametrize("rows", [9, 1, 0])
def test_sparse_experts_equal_the_reference_maths(rows: int) -> None:
    """``sparse_experts`` computes each expert on its routed rows only: the same outputs and
    gradients (inputs, weights) as the reference that runs every expert on every row, with
    experts that get no row, skipped slots and an empty batch."""
    gen = torch.Generator().manual_seed(3)
    ref = moe.Experts(moe.MoEConfig())
    sparse = moe.Experts(moe.MoEConfig(sparse_experts=True))
    sparse.load_state_dict(ref.state_dict())
    x = torch.randn(rows, ref.w1.shape[2], generator=gen)
    index, weights = _skewed_routing(rows, 2, ref.w1.shape[0], gen)
    outs, grads = [], []
    for experts in (ref, sparse):
        xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = experts(xi, index, wi)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append(out)
        grads.append([xi.grad, wi.grad, experts.w1.grad, experts.w2.grad, experts.w3.grad])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)
    for got, want in zip(grads[1], grads[0], strict=True):
        assert got is not None and want is not None
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert not sparse.w1.grad[[2, 4, 6, 7]].any()  # unrouted experts: zero gradients


def test_sparse_experts_model_trains_like_the_reference() -> None:
    """The whole model with ``sparse_experts``: the same logits and parameter gradients."""
    ref = moe.tiny()
    sparse = moe.tiny(sparse_experts=True)
    moe.init_weights(ref, seed=5, std=0.1)
    sparse.load_state_dict(ref.state_dict())
    tokens = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(4))
    for m in (ref, sparse):
        m(tokens).square().mean().backward()
    torch.testing.assert_close(sparse(tokens), ref(tokens), atol=1e-6, rtol=1e-6)
    for (name, p), q in zip(ref.named_parameters(), sparse.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-6, msg=name)


def test_moe_local_experts_ep1_equals_stacked() -> None:
    stacked = moe.tiny().eval()
    moe.init_weights(stacked, seed=11, std=0.1)
    local = moe.tiny_local(ep=1).eval()
    local.load_state_dict(
        moe.local_expert_state(stacked.state_dict(), ep_rank=0, ep=1, cfg=stacked.config),
        strict=True,
    )
    tokens = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(local(tokens), stacked(tokens), atol=1e-6, rtol=0)


def test_local_expert_state_for_one_rank_of_ep2() -> None:
    stacked = moe.tiny()
    full = stacked.state_dict()
    local = moe.tiny_local(ep=2)
    state = moe.local_expert_state(full, ep_rank=1, ep=2, cfg=stacked.config)
    local.load_state_dict(state, strict=True)
    for j in range(4):
        for n in ("w1", "w2", "w3"):
            got = getattr(local.layers["1"].moe.local_experts[j], n).weight
            assert torch.equal(got, full[f"layers.1.moe.experts.{n}"][4 + j])
    assert state["layers.0.attn.fp8_meta._extra_state"] == {"scale": 1.0}
    with pytest.raises(NotImplementedError, match="ep=2"):
        local(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError):
        moe.local_expert_state(full, ep_rank=2, ep=2, cfg=stacked.config)


def test_moe_extra_state_round_trip_and_hc_head_is_used() -> None:
    model = moe.tiny()
    state = model.state_dict()
    state["layers.1.attn.fp8_meta._extra_state"] = {"scale": 2.0}
    model.load_state_dict(state)
    assert model.layers["1"].attn.fp8_meta.get_extra_state() == {"scale": 2.0}
    assert model.layers["0"].attn.fp8_meta.get_extra_state() == {"scale": 1.0}

    model(torch.randint(0, 256, (2, 4))).square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
    assert all(p.grad.abs().sum() > 0 for p in model.hc_head.parameters())
