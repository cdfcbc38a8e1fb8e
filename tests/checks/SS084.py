"""SS084 hf-dtype-kind: the HF manifest gives a key a dtype of another kind than its
parameter's (F32 bytes relabelled I32), or no safetensors dtype."""

from shardspec.inputs.hfmanifest import dump_hf_manifest
from tests.checks.hf_model import GOOD, HEAD, HF, MANIFEST, TENSORS


def hf_text(**dtypes: str) -> str:
    """The shared HF manifest, with the dtypes of some keys changed (keyword: the key with
    dots as underscores)."""
    tensors = {
        k: {
            "shape": list(shape),
            "dtype": dtypes.get(k.replace(".", "_"), "F32"),
            "file": "model.safetensors",
        }
        for k, shape in TENSORS.items()
    }
    return dump_hf_manifest(
        {"format": "shardspec-hf-manifest/1", "config": HF["config"], "tensors": tensors}
    )


CASES = [
    {
        "name": "an integer key for a floating parameter",
        "spec": HEAD + GOOD,
        "manifest": MANIFEST,
        "hf_manifest_text": hf_text(model_norm_weight="I32"),
        "expect": [
            (
                "SS084",
                7,
                "HF key 'model.norm.weight' is I32 (int values) in the HF manifest, and line 7 "
                "loads it into a float32 parameter",
                "model.norm.weight",
                "load_hf never casts int data to float",
            ),
        ],
    },
    {
        "name": "every layer's key, counted once per line",
        "spec": HEAD + GOOD,
        "manifest": MANIFEST,
        "hf_manifest_text": hf_text(model_layers_0_up="BOOL", model_layers_1_up="BOOL"),
        "expect": [
            (
                "SS084",
                9,
                "HF key 'model.layers.0.up' (and 1 more) is BOOL (bool values)",
                "model.layers.{i}.up",
            ),
        ],
    },
    {
        "name": "no safetensors dtype",
        "spec": HEAD + GOOD,
        "manifest": MANIFEST,
        "hf_manifest_text": hf_text(model_norm_weight="Q4"),
        "expect": [("SS084", 7, "is 'Q4', which is no safetensors dtype")],
    },
    {
        "name": "bf16 and fp16 keys for float32 parameters: a cast load_hf makes",
        "spec": HEAD + GOOD,
        "manifest": MANIFEST,
        "hf_manifest_text": hf_text(model_norm_weight="BF16", model_layers_0_gate="F16"),
        "expect": [],
    },
]
