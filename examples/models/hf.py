"""Hugging Face twins of the example models, and hand-written weight conversions.

:func:`llama_config` and :func:`qwen3_moe_config` give the ``transformers`` configs whose
models compute what :mod:`examples.models.llama` and :mod:`examples.models.moe` (with
``hc_mult=0``) compute. :func:`llama_from_hf` and :func:`moe_from_hf` convert a Hugging
Face state dict into the example models' global state dicts. They are written by hand,
independently of the spec's ``hf`` block, so tests can use them as an oracle for
``load_hf``/``export_hf``.

``transformers`` is imported lazily: the example models do not need it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from examples.models import llama, moe

__all__ = [
    "deepseek_v3_config",
    "deepseek_v3_tiny",
    "gpt2_config",
    "gpt2_tiny",
    "gpt_oss_config",
    "gpt_oss_tiny",
    "hf_rope_to_meta",
    "llama_config",
    "llama_from_hf",
    "meta_rope_to_hf",
    "moe_from_hf",
    "phi3_config",
    "phi3_tiny",
    "qwen2_config",
    "qwen2_tiny",
    "qwen3_config",
    "qwen3_moe_config",
    "qwen3_tiny",
]


def llama_config(cfg: llama.LlamaConfig | None = None, *, tied: bool | None = None) -> Any:
    """A ``transformers.LlamaConfig`` for the example Llama (``cfg``, default tiny)."""
    import transformers

    cfg = cfg or llama.LlamaConfig()
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings if tied is None else tied,
        attn_implementation="eager",
    )


def qwen3_moe_config(cfg: moe.MoEConfig | None = None, *, tied: bool | None = None) -> Any:
    """A ``transformers.Qwen3MoeConfig`` for the example MoE (``hc_mult`` must be 0)."""
    import transformers

    cfg = cfg or moe.MoEConfig(hc_mult=0)
    return transformers.Qwen3MoeConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=4 * cfg.dim,  # the dense MLP's width; unused, every layer is MoE
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        moe_intermediate_size=cfg.moe_ffn_dim,
        num_experts=cfg.n_experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings if tied is None else tied,
        attn_implementation="eager",
    )


def hf_rope_to_meta(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a q/k projection from HF's rotate-half layout to Meta's interleaved one."""
    return w.unflatten(0, (-1, 2, head_dim // 2)).transpose(1, 2).reshape(w.shape)


def meta_rope_to_hf(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of :func:`hf_rope_to_meta`."""
    return w.unflatten(0, (-1, head_dim // 2, 2)).transpose(1, 2).reshape(w.shape)


def llama_from_hf(
    hf: Mapping[str, torch.Tensor], cfg: llama.LlamaConfig
) -> dict[str, torch.Tensor]:
    """The example Llama's global state dict from a ``LlamaForCausalLM`` state dict.

    A tied model (``cfg.tie_embeddings``) has no ``output.weight``; an untied one reads
    ``lm_head.weight``, or ``model.embed_tokens.weight`` when the checkpoint is tied.
    """
    out = {
        "tok_embeddings.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
    }
    if not cfg.tie_embeddings:
        out["output.weight"] = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    for i in range(cfg.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        wq = hf_rope_to_meta(hf[q + "self_attn.q_proj.weight"], cfg.head_dim)
        wk = hf_rope_to_meta(hf[q + "self_attn.k_proj.weight"], cfg.head_dim)
        wv = hf[q + "self_attn.v_proj.weight"]
        out |= {
            p + "attention_norm.weight": hf[q + "input_layernorm.weight"],
            p + "attention.wqkv.weight": llama.fuse_wqkv(wq, wk, wv, cfg),
            p + "attention.wo.weight": hf[q + "self_attn.o_proj.weight"],
            p + "ffn_norm.weight": hf[q + "post_attention_layernorm.weight"],
            p + "feed_forward.w13.weight": torch.cat(
                (hf[q + "mlp.gate_proj.weight"], hf[q + "mlp.up_proj.weight"])
            ),
            p + "feed_forward.w2.weight": hf[q + "mlp.down_proj.weight"],
        }
    return out


def moe_from_hf(hf: Mapping[str, torch.Tensor], cfg: moe.MoEConfig) -> dict[str, torch.Tensor]:
    """The example MoE's global state dict (stacked experts) from a ``Qwen3MoeForCausalLM``
    state dict with per-expert keys (what ``save_pretrained`` writes)."""
    out = {"embed.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["head.weight"] = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    names = {
        "attn_norm.weight": "input_layernorm.weight",
        "attn.wq.weight": "self_attn.q_proj.weight",
        "attn.wk.weight": "self_attn.k_proj.weight",
        "attn.wv.weight": "self_attn.v_proj.weight",
        "attn.wo.weight": "self_attn.o_proj.weight",
        "attn.q_norm.weight": "self_attn.q_norm.weight",
        "attn.k_norm.weight": "self_attn.k_norm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "moe.router.weight": "mlp.gate.weight",
    }
    for i in range(cfg.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out |= {p + ours: hf[q + theirs] for ours, theirs in names.items()}
        for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            out[f"{p}moe.experts.{ours}"] = torch.stack(
                [hf[f"{q}mlp.experts.{e}.{theirs}.weight"] for e in range(cfg.n_experts)]
            )
    return out


def _qwen_fields(**overrides: Any) -> dict[str, Any]:
    """The tiny Qwen2/Qwen3 configs' fields: hidden 64 in 4 heads (2 kv heads), untied."""
    return {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        "attn_implementation": "sdpa",
        **overrides,
    }


def qwen2_config(**overrides: Any) -> Any:
    """A tiny ``transformers.Qwen2Config`` (q/k/v biases, GQA with 2 kv heads, untied)."""
    import transformers

    return transformers.Qwen2Config(**_qwen_fields(**overrides))


def qwen2_tiny(**overrides: Any) -> Any:
    """``transformers.Qwen2ForCausalLM`` from :func:`qwen2_config`, used as it is (no
    changes to the model): the manifest factory of ``specs/qwen2.shard``."""
    import transformers

    return transformers.Qwen2ForCausalLM(qwen2_config(**overrides))


def qwen3_config(**overrides: Any) -> Any:
    """A tiny ``transformers.Qwen3Config``: Qwen2's sizes (no q/k/v biases), with per-head
    q/k RMSNorms of weight [head_dim] (16) on the per-head activations."""
    import transformers

    return transformers.Qwen3Config(**_qwen_fields(**{"head_dim": 16, **overrides}))


def qwen3_tiny(**overrides: Any) -> Any:
    """``transformers.Qwen3ForCausalLM`` from :func:`qwen3_config`, used as it is: the
    manifest factory of ``specs/qwen3.shard``."""
    import transformers

    return transformers.Qwen3ForCausalLM(qwen3_config(**overrides))


def phi3_config(**overrides: Any) -> Any:
    """A tiny ``transformers.Phi3Config``: fused ``qkv_proj`` (all q rows, then k, then v)
    and ``gate_up_proj``; GQA with 2 kv heads of 4 (``num_key_value_heads=4`` is MHA)."""
    import transformers

    fields: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "original_max_position_embeddings": 128,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attn_implementation": "eager",
        **overrides,
    }
    return transformers.Phi3Config(**fields)


def phi3_tiny(**overrides: Any) -> Any:
    """``transformers.Phi3ForCausalLM`` from :func:`phi3_config`, used as it is: the
    manifest factory of ``specs/phi3.shard`` (``num_key_value_heads=4``: the MHA variant)."""
    import transformers

    return transformers.Phi3ForCausalLM(phi3_config(**overrides))


def gpt2_config(**overrides: Any) -> Any:
    """A tiny ``transformers.GPT2Config``: Conv1D weights stored ``[in, out]``, q|k|v fused
    along the last dimension of ``c_attn``; the LM head tied to the token embedding."""
    import transformers

    fields: dict[str, Any] = {
        "vocab_size": 256,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 128,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attn_implementation": "eager",
        **overrides,
    }
    return transformers.GPT2Config(**fields)


def gpt2_tiny(**overrides: Any) -> Any:
    """``transformers.GPT2LMHeadModel`` from :func:`gpt2_config`, used as it is: the
    manifest factory of ``specs/gpt2.shard``."""
    import transformers

    return transformers.GPT2LMHeadModel(gpt2_config(**overrides))


def deepseek_v3_config(**overrides: Any) -> Any:
    """A tiny ``transformers.DeepseekV3Config``: multi-head latent attention, one dense layer
    then one MoE layer with 4 routed experts (stacked ``gate_up_proj`` [experts, gate|up,
    hidden] and ``down_proj`` in the model, one tensor per expert in the checkpoint), a
    shared expert, and group-limited routing (2 groups, 1 chosen) whose router holds the
    persistent buffer ``mlp.gate.e_score_correction_bias``: an HF key as well as model
    state."""
    import transformers

    fields: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        "attn_implementation": "eager",
        **overrides,
    }
    return transformers.DeepseekV3Config(**fields)


def deepseek_v3_tiny(**overrides: Any) -> Any:
    """``transformers.DeepseekV3ForCausalLM`` from :func:`deepseek_v3_config`, used as it is:
    the manifest factory of ``specs/deepseek_v3.shard``."""
    import transformers

    return transformers.DeepseekV3ForCausalLM(deepseek_v3_config(**overrides))


def gpt_oss_config(**overrides: Any) -> Any:
    """A tiny ``transformers.GptOssConfig``: stacked experts whose ``gate_up_proj``
    ``[expert, hidden, 2 * intermediate]`` (and its bias) interleave gate and up (gate is
    ``[..., ::2]``, up ``[..., 1::2]``); attention with biases and sinks, GQA with 2 kv
    heads of 16."""
    import transformers

    fields: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 128,
        "sliding_window": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0},
        "tie_word_embeddings": False,
        "attn_implementation": "eager",
        **overrides,
    }
    return transformers.GptOssConfig(**fields)


def gpt_oss_tiny(**overrides: Any) -> Any:
    """``transformers.GptOssForCausalLM`` from :func:`gpt_oss_config`, used as it is: the
    manifest factory of ``specs/gpt_oss.shard``."""
    import transformers

    return transformers.GptOssForCausalLM(gpt_oss_config(**overrides))
