"""Synthetic DeepSeek-V3-like MoE specs and manifests of any size, for benchmarks and tests.

The model follows Hugging Face's DeepSeek-V3 names and shapes: multi-head latent attention
(``q_a_proj``/``q_b_proj``, ``kv_a_proj_with_mqa``/``kv_b_proj``), ``first_dense`` dense
layers, then MoE layers with a router, shared experts and *unfused* routed experts, one
module per expert (``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``).

The experts are expert-parallel the Megatron way: each EP rank builds only its own
``experts_per_rank`` expert modules, so the manifest (one EP rank's view) names local
experts ``0 .. experts_per_rank - 1`` and records ``ep`` in ``factory_args``; the spec
indexes them with an ``{expert}`` capture and ``local ep``. Every shape divides evenly over
the mesh ``dp_shard x ep x tp``, so the pair lints clean.

Sizes scale by MoE layers and experts per rank: a model has
``3 + 12 * first_dense + moe_layers * (13 + 3 * experts_per_rank)`` parameters (DeepSeek-V3
itself, 58 MoE layers of 256 unfused experts, would be about 45k). :func:`config_for` picks a
configuration near a wanted count.

With ``--hf`` (:func:`write_hf`) it also writes ``DIR/moe_hf.shard``: the same spec plus an
``hf "moe.hf.json" { ... }`` block of identity map lines, one per parameter template
(``model.layers.{i}.mlp.experts.{e}.gate_proj.weight -> model.layers.{i}.mlp.experts.{e}.
gate_proj.weight``), one for the router's persistent buffer ``e_score_correction_bias``
(stored as parameters are, whole on every rank) and ``config`` bindings; and
``DIR/moe.hf.json``, the HF manifest (``shardspec-hf-manifest/1``) of the matching Hugging
Face checkpoint: every key with its shape, routed experts under their
global index (``experts_per_rank * ep`` per layer, one storage unit each). The pair lints
clean, so the HF-manifest checks (keys, shapes, config values) run in full. Without the
HF manifest (``hf_manifest=False``) the block names no file and suppresses SS079.

Pure Python, standard library only: ``python -m bench.synth N DIR [--hf]`` writes
``DIR/moe.shard`` and ``DIR/moe.manifest.json`` (and the hf variant).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

FORMAT = "shardspec-manifest/1"
HF_FORMAT = "shardspec-hf-manifest/1"


@dataclass(frozen=True)
class Config:
    moe_layers: int
    experts_per_rank: int
    first_dense: int = 3
    # Mesh: dp_shard takes the rest of the world.
    world: int = 64
    ep: int = 8
    tp: int = 2
    # DeepSeek-V3's sizes.
    hidden: int = 7168
    vocab: int = 129280
    ffn: int = 18432  # dense layers
    moe_ffn: int = 2048  # routed and shared experts
    q_lora: int = 1536
    kv_lora: int = 512
    heads: int = 128
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128
    dtype: str = "bfloat16"

    @property
    def layers(self) -> int:
        return self.first_dense + self.moe_layers

    @property
    def n_params(self) -> int:
        return 3 + 12 * self.first_dense + self.moe_layers * (13 + 3 * self.experts_per_rank)

    @property
    def dp_shard(self) -> int:
        return self.world // (self.ep * self.tp)

    @property
    def experts(self) -> int:
        """Routed experts per MoE layer, over all EP ranks."""
        return self.experts_per_rank * self.ep

    @property
    def n_units(self) -> int:
        """Storage units (and HF tensors mapped to them): experts under global indices, and
        the router's buffer."""
        return 3 + 12 * self.first_dense + self.moe_layers * (14 + 3 * self.experts)


def config_for(n_params: int, **overrides: int) -> Config:
    """A configuration with about ``n_params`` parameters: more experts for bigger models."""
    experts = 16 if n_params <= 2_000 else 64 if n_params <= 20_000 else 256
    base = Config(moe_layers=1, experts_per_rank=experts, **overrides)
    per_layer = 13 + 3 * experts
    fixed = base.n_params - per_layer
    layers = max(1, round((n_params - fixed) / per_layer))
    return Config(moe_layers=layers, experts_per_rank=experts, **overrides)


def spec_text(cfg: Config, manifest_name: str = "moe.manifest.json") -> str:
    """The ``.shard`` file: FSDP2 on dp_shard, TP on tp, routed experts local over ep."""
    return f"""\
# Synthetic DeepSeek-V3-like MoE (bench/synth.py): {cfg.layers} layers, the first
# {cfg.first_dense} dense, {cfg.experts_per_rank} unfused experts per EP rank.
manifest "{manifest_name}"

mesh over {cfg.world} ranks {{
    dp_shard: *
    ep: {cfg.ep}
    tp: {cfg.tp}
}}

fsdp dp_shard

ignore **._extra_state

param model.embed_tokens.weight [vocab, hidden] {{
    shard vocab over tp
}}
param lm_head.weight [vocab, hidden] {{
    shard vocab over tp
}}

# Multi-head latent attention: the low-rank down projections are FSDP only, the up
# projections column-parallel, the output row-parallel.
param model.layers.*.self_attn.q_a_proj.weight [q_lora, hidden] {{}}
param model.layers.*.self_attn.q_b_proj.weight [heads, q_lora] {{
    shard heads over tp
}}
param model.layers.*.self_attn.kv_a_proj_with_mqa.weight [kv_rope, hidden] {{}}
param model.layers.*.self_attn.kv_b_proj.weight [heads, kv_lora] {{
    shard heads over tp
}}
param model.layers.*.self_attn.o_proj.weight [hidden, heads] {{
    shard heads over tp
}}
param **.*norm.weight [dim] {{}}

# Dense MLP (the first layers) and shared experts.
param model.layers.*.mlp.{{gate,up}}_proj.weight [ffn, hidden] {{
    shard ffn over tp
}}
param model.layers.*.mlp.down_proj.weight [hidden, ffn] {{
    shard ffn over tp
}}
param model.layers.*.mlp.shared_experts.{{gate,up}}_proj.weight [ffn, hidden] {{
    shard ffn over tp
}}
param model.layers.*.mlp.shared_experts.down_proj.weight [hidden, ffn] {{
    shard ffn over tp
}}

# The router sees every expert; FSDP only.
param model.layers.*.mlp.gate.weight [expert, hidden] {{}}

# Routed experts: one module per expert, each EP rank building only its own.
param model.layers.*.mlp.experts.{{expert}}.{{gate,up}}_proj.weight [expert, ffn, hidden] {{
    local ep
    shard expert over ep
    shard ffn over tp
}}
param model.layers.*.mlp.experts.{{expert}}.down_proj.weight [expert, hidden, ffn] {{
    local ep
    shard expert over ep
    shard ffn over tp
}}
"""


def manifest_entries(cfg: Config) -> list[dict]:
    """Every state-dict entry, unsorted: parameters, one buffer and one extra state per layer."""
    h, dt = cfg.hidden, cfg.dtype
    out: list[dict] = []

    def param(fqn: str, *shape: int) -> None:
        out.append({"fqn": fqn, "kind": "param", "shape": list(shape), "dtype": dt})

    def mlp(prefix: str, ffn: int) -> None:
        param(prefix + "gate_proj.weight", ffn, h)
        param(prefix + "up_proj.weight", ffn, h)
        param(prefix + "down_proj.weight", h, ffn)

    param("model.embed_tokens.weight", cfg.vocab, h)
    param("model.norm.weight", h)
    param("lm_head.weight", cfg.vocab, h)
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        param(p + "input_layernorm.weight", h)
        param(p + "post_attention_layernorm.weight", h)
        param(a + "q_a_proj.weight", cfg.q_lora, h)
        param(a + "q_a_layernorm.weight", cfg.q_lora)
        param(a + "q_b_proj.weight", cfg.heads * (cfg.qk_nope + cfg.qk_rope), cfg.q_lora)
        param(a + "kv_a_proj_with_mqa.weight", cfg.kv_lora + cfg.qk_rope, h)
        param(a + "kv_a_layernorm.weight", cfg.kv_lora)
        param(a + "kv_b_proj.weight", cfg.heads * (cfg.qk_nope + cfg.v_head), cfg.kv_lora)
        param(a + "o_proj.weight", h, cfg.heads * cfg.v_head)
        out.append({"fqn": a + "fp8_meta._extra_state", "kind": "extra_state"})
        if i < cfg.first_dense:
            mlp(p + "mlp.", cfg.ffn)
            continue
        n_experts = cfg.experts_per_rank * cfg.ep
        param(p + "mlp.gate.weight", n_experts, h)
        out.append(
            {
                "fqn": p + "mlp.gate.e_score_correction_bias",
                "kind": "buffer",
                "shape": [n_experts],
                "dtype": "float32",
            }
        )
        mlp(p + "mlp.shared_experts.", cfg.moe_ffn)
        for e in range(cfg.experts_per_rank):
            mlp(f"{p}mlp.experts.{e}.", cfg.moe_ffn)
    return out


def manifest_text(cfg: Config) -> str:
    """The manifest in ``shardspec manifest``'s canonical form (one entry per line, sorted)."""
    entries = sorted(manifest_entries(cfg), key=lambda e: e["fqn"])
    head = {"format": FORMAT, "factory": None, "factory_args": {"ep": cfg.ep}}
    body = ",\n    ".join(json.dumps(e, separators=(", ", ": ")) for e in entries)
    return "{" + json.dumps(head)[1:-1] + ',\n  "entries": [\n    ' + body + "\n  ]\n}\n"


# ------------------------------------------------------------------ the Hugging Face side

_LAYER = re.compile(r"^model\.layers\.[0-9]+\.")
_EXPERT = re.compile(r"\.experts\.[0-9]+\.")


def param_templates(cfg: Config) -> list[str]:
    """The parameter names with ``{i}`` for the layer and ``{e}`` for the expert, sorted."""
    out = set()
    for e in manifest_entries(cfg):
        if e["kind"] == "param":
            t = _LAYER.sub("model.layers.{i}.", e["fqn"])
            out.add(_EXPERT.sub(".experts.{e}.", t))
    return sorted(out)


def hf_block(cfg: Config, hf_manifest_name: str | None = "moe.hf.json") -> str:
    """The ``hf`` block: identity map lines (HF names are the model's), one per template
    and one for the router's buffer."""
    head = f'hf "{hf_manifest_name}" {{' if hf_manifest_name else "hf {  # shardspec: ignore[SS079]"
    lines = [f"    {t} -> {t}" for t in param_templates(cfg)]
    bias = "model.layers.{i}.mlp.gate.e_score_correction_bias"
    lines += [
        f"    {bias} -> {bias}",
        "    config hidden = hidden_size",
        "    config vocab = vocab_size",
        "    config q_lora = q_lora_rank",
        "    config kv_lora = kv_lora_rank",
        "    config expert = n_routed_experts",
    ]
    return "\n".join(
        ["", "# The Hugging Face checkpoint (bench/synth.py: hf_block).", head, *lines, "}", ""]
    )


def hf_tensors(cfg: Config) -> dict[str, tuple[list[int], str]]:
    """The HF checkpoint's tensors: ``{key: (shape, file)}``, routed experts under every
    global index, plus the router's ``e_score_correction_bias`` (a buffer)."""
    files = cfg.layers + 1
    out: dict[str, tuple[list[int], str]] = {}
    for e in manifest_entries(cfg):
        fqn = e["fqn"]
        m = re.match(r"^model\.layers\.([0-9]+)\.", fqn)
        file = f"model-{(int(m.group(1)) if m else cfg.layers) + 1:05d}-of-{files:05d}.safetensors"
        if e["kind"] == "buffer":
            out[fqn] = (e["shape"], file)
        if e["kind"] != "param":
            continue
        x = _EXPERT.search(fqn)
        if x is None:
            out[fqn] = (e["shape"], file)
        elif x.group(0) == ".experts.0.":  # local expert 0 stands for all global ones
            for g in range(cfg.experts):
                out[f"{fqn[: x.start()]}.experts.{g}.{fqn[x.end() :]}"] = (e["shape"], file)
    return out


def hf_config(cfg: Config) -> dict[str, int | str]:
    """config.json, the keys DeepSeek-V3's has for these sizes."""
    return {
        "model_type": "deepseek_v3",
        "hidden_size": cfg.hidden,
        "vocab_size": cfg.vocab,
        "intermediate_size": cfg.ffn,
        "moe_intermediate_size": cfg.moe_ffn,
        "q_lora_rank": cfg.q_lora,
        "kv_lora_rank": cfg.kv_lora,
        "num_attention_heads": cfg.heads,
        "qk_nope_head_dim": cfg.qk_nope,
        "qk_rope_head_dim": cfg.qk_rope,
        "v_head_dim": cfg.v_head,
        "n_routed_experts": cfg.experts,
        "first_k_dense_replace": cfg.first_dense,
        "num_hidden_layers": cfg.layers,
    }


def hf_manifest_text(cfg: Config) -> str:
    """The HF manifest in ``shardspec hf-manifest``'s canonical form (sorted, one tensor a
    line), as ``shardspec.inputs.hfmanifest.dump_hf_manifest`` writes it."""
    dtype = {"bfloat16": "BF16", "float32": "F32"}.get(cfg.dtype, "BF16")
    lines = [
        f"{json.dumps(k)}: "
        + json.dumps({"shape": shape, "dtype": dtype, "file": file}, separators=(", ", ": "))
        for k, (shape, file) in sorted(hf_tensors(cfg).items())
    ]
    config = json.dumps(hf_config(cfg), sort_keys=True)
    body = ",\n    ".join(lines)
    return (
        f'{{"format": {json.dumps(HF_FORMAT)},\n  "config": {config},\n'
        f'  "tensors": {{\n    {body}\n  }}\n}}\n'
    )


def write(cfg: Config, out_dir: str | Path, name: str = "moe") -> Path:
    """Write ``NAME.shard`` and ``NAME.manifest.json`` into ``out_dir``; return the spec path."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    manifest = f"{name}.manifest.json"
    (d / manifest).write_text(manifest_text(cfg), encoding="utf-8")
    spec = d / f"{name}.shard"
    spec.write_text(spec_text(cfg, manifest), encoding="utf-8")
    return spec


def write_hf(cfg: Config, out_dir: str | Path, name: str = "moe", hf_manifest: bool = True) -> Path:
    """Write ``NAME_hf.shard`` (``NAME.shard`` plus the hf block) and, with ``hf_manifest``,
    ``NAME.hf.json`` (else ``NAME_hf_nofile.shard``, whose block names no HF manifest);
    ``NAME.manifest.json`` too if it is not there. Return the spec path."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    manifest = f"{name}.manifest.json"
    if not (d / manifest).exists():
        (d / manifest).write_text(manifest_text(cfg), encoding="utf-8")
    hf_name = f"{name}.hf.json" if hf_manifest else None
    if hf_name:
        (d / hf_name).write_text(hf_manifest_text(cfg), encoding="utf-8")
    spec = d / (f"{name}_hf.shard" if hf_manifest else f"{name}_hf_nofile.shard")
    spec.write_text(spec_text(cfg, manifest) + hf_block(cfg, hf_name), encoding="utf-8")
    return spec


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    hf = "--hf" in args
    args = [a for a in args if a != "--hf"]
    if len(args) != 2 or not args[0].isdigit():
        sys.stderr.write("usage: python -m bench.synth N_PARAMS OUT_DIR [--hf]\n")
        return 2
    cfg = config_for(int(args[0]))
    spec = write(cfg, args[1])
    sys.stdout.write(
        f"wrote {spec} ({cfg.n_params} params: {cfg.moe_layers} MoE layers x "
        f"{cfg.experts_per_rank} experts per rank)\n"
    )
    if hf:
        for with_file in (True, False):
            spec = write_hf(cfg, args[1], hf_manifest=with_file)
            sys.stdout.write(f"wrote {spec} ({cfg.n_units} storage units)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
