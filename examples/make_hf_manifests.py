"""(Re)build the example specs' HF manifests from tiny Hugging Face models.

    python examples/make_hf_manifests.py            # writes specs/*.hf.json
    python examples/make_hf_manifests.py -o DIR     # somewhere else (the test compares)

Each model is built by ``transformers`` from a config object matching the example model's
defaults (no download), saved with ``save_pretrained`` into a temporary directory, and
described by ``shardspec hf-manifest``. ``transformers_version`` is left out of the config
so that the files change only when the models do.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `examples` and `shardspec` importable
    sys.path.insert(0, str(ROOT))
SPECS = ROOT / "specs"


def llama_config():  # -> transformers.LlamaConfig
    """The Hugging Face config of ``examples.models.llama.LlamaConfig()`` (untied)."""
    from examples.models import hf

    return hf.llama_config(tied=False)


def qwen3_moe_config():  # -> transformers.Qwen3MoeConfig
    """The Qwen3-MoE config of ``examples.models.moe.MoEConfig()`` (the deepseek_moe
    manifests' model; its hyper-connection head has no Hugging Face counterpart)."""
    from examples.models import hf, moe

    return hf.qwen3_moe_config(moe.MoEConfig())


def _save(kind: str, folder: Path) -> None:
    import torch
    import transformers

    from examples.models import hf

    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(llama_config())
    elif kind == "phi3":
        model = hf.phi3_tiny()
    elif kind == "gpt2":
        model = hf.gpt2_tiny()
    elif kind in ("deepseek_v3", "deepseek_v3_fp8"):
        model = hf.deepseek_v3_tiny()
    elif kind == "gpt_oss":
        model = hf.gpt_oss_tiny()
    elif kind == "qwen2":
        model = hf.qwen2_tiny()
    else:
        model = transformers.Qwen3MoeForCausalLM(qwen3_moe_config())
    model.save_pretrained(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("transformers_version", None)
    if kind == "deepseek_v3_fp8":
        config["quantization_config"] = _fp8_checkpoint(folder)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")


# The tensors DeepSeek-V3's FP8 release stores in float8_e4m3fn, each with a float32
# `weight_scale_inv` per 128 x 128 block (the attention and MLP projections, the experts'
# included); the embeddings, norms, router and lm_head stay in BF16, the router's
# e_score_correction_bias in F32.
FP8_WEIGHT = re.compile(r"model\.layers\.[0-9]+\.(self_attn|mlp)\..*(_proj|_mqa)\.weight")
BLOCK = 128


def _fp8_checkpoint(folder: Path) -> dict[str, object]:
    """Rewrite the float32 checkpoint in ``folder`` as DeepSeek ships its FP8 one, each
    block quantized as the format defines it (scale = the block's amax / 448; the scale
    stored is its inverse's inverse, ``weight_scale_inv``, by which the FP8 values are
    multiplied); the ``quantization_config`` that says so."""
    import torch
    from safetensors.torch import load_file, save_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        for key, t in load_file(path).items():
            if FP8_WEIGHT.fullmatch(key):
                out[key], out[f"{key}_scale_inv"] = _quantize(t)
            elif key.endswith("e_score_correction_bias"):
                out[key] = t.float()
            else:
                out[key] = t.to(torch.bfloat16)
        path.unlink()
    for index in folder.glob("*.index.json"):
        index.unlink()
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
    }


def _quantize(w):  # (torch.Tensor) -> (fp8 tensor, float32 scales)
    """``w`` [R, C] as float8_e4m3fn per 128 x 128 block, and the blocks' scales."""
    import torch

    rows, cols = w.shape
    nr, nc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(nr * BLOCK, nc * BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(nr, BLOCK, nc, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(nr * BLOCK, nc * BLOCK)[:rows, :cols].contiguous(), scale


# spec HF manifest -> the model it describes
MANIFESTS = {
    "llama.hf.json": "llama",
    "llama_local.hf.json": "llama",
    "deepseek_moe.hf.json": "qwen3_moe",
    "deepseek_moe_local.hf.json": "qwen3_moe",
    "phi3.hf.json": "phi3",  # transformers' own models, used as they are
    "gpt2.hf.json": "gpt2",
    "deepseek_v3.hf.json": "deepseek_v3",
    "deepseek_v3_fp8.hf.json": "deepseek_v3_fp8",  # its FP8 release's format
    "gpt_oss.hf.json": "gpt_oss",
    "qwen2.hf.json": "qwen2",  # the trainer and the vLLM-style engines of specs/qwen2*.shard
}


def build(out_dir: str | Path) -> list[Path]:
    """Write every HF manifest into ``out_dir``; the paths written."""
    from shardspec.inputs.hfmanifest import write_hf_manifest

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in sorted(set(MANIFESTS.values())):
            _save(kind, Path(tmp) / kind)
        for name, kind in MANIFESTS.items():
            write_hf_manifest(Path(tmp) / kind, out / name)
            written.append(out / name)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--out", default=str(SPECS), metavar="DIR", help="default: specs/")
    args = p.parse_args(argv)
    for path in build(args.out):
        sys.stdout.write(f"wrote {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
