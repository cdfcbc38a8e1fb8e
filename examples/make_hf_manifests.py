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
    elif kind == "deepseek_v3":
        model = hf.deepseek_v3_tiny()
    elif kind == "gpt_oss":
        model = hf.gpt_oss_tiny()
    else:
        model = transformers.Qwen3MoeForCausalLM(qwen3_moe_config())
    model.save_pretrained(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("transformers_version", None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")


# spec HF manifest -> the model it describes
MANIFESTS = {
    "llama.hf.json": "llama",
    "llama_local.hf.json": "llama",
    "deepseek_moe.hf.json": "qwen3_moe",
    "deepseek_moe_local.hf.json": "qwen3_moe",
    "phi3.hf.json": "phi3",  # transformers' own models, used as they are
    "gpt2.hf.json": "gpt2",
    "deepseek_v3.hf.json": "deepseek_v3",
    "gpt_oss.hf.json": "gpt_oss",
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
