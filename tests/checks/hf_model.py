"""The small model, HF checkpoint and hf block that the SS07x cases share."""

from shardspec.inputs.hfmanifest import dump_hf_manifest

# A small model: a norm, a fused gate/up per layer, stacked experts in layer 0.
HEAD = """\
manifest "m.json"
mesh over 2 ranks { tp: 2 }
param norm.weight [hidden] {}
param layers.*.w13 [ffn, hidden] { fuse ffn as gate, up }
param layers.*.experts [expert, ffn, hidden] {}
"""
MANIFEST = {
    "layers.0.experts": [2, 4, 8],
    "layers.0.w13": [8, 8],
    "layers.1.w13": [8, 8],
    "norm.weight": [8],
}
TENSORS = {
    "model.layers.0.experts.0.w1": [4, 8],
    "model.layers.0.experts.1.w1": [4, 8],
    "model.layers.0.gate": [4, 8],
    "model.layers.0.up": [4, 8],
    "model.layers.1.gate": [4, 8],
    "model.layers.1.up": [4, 8],
    "model.norm.weight": [8],
}
HF = {"config": {"hidden_size": 8, "intermediate_size": 4, "num_experts": 2}, "tensors": TENSORS}
# Lines 6-11: the hf block; map lines 7-10.
GOOD = """\
hf "hf.json" {
    model.norm.weight -> norm.weight
    model.layers.{i}.gate -> layers.{i}.w13.gate
    model.layers.{i}.up -> layers.{i}.w13.up
    model.layers.{i}.experts.{e}.w1 -> layers.{i}.experts[e]
}
"""

# The same checkpoint stored as DeepSeek ships one (SS110-SS114): the linear weights
# F8_E4M3, each with a float32 scale per 128 x 128 block (one, at these sizes), the norm F32.
FP8_KEYS = [k for k in TENSORS if k != "model.norm.weight"]
FP8_TENSORS: dict[str, tuple[list[int], str]] = {
    **{k: (shape, "F8_E4M3") for k, shape in TENSORS.items() if k in FP8_KEYS},
    **{f"{k}_scale_inv": ([1, 1], "F32") for k in FP8_KEYS},
    "model.norm.weight": ([8], "F32"),
}
# Lines 6-14: GOOD's block with three fp8 lines (lines 11-13).
FP8_LINES = """\
    fp8 model.layers.*.gate
    fp8 model.layers.*.up
    fp8 model.layers.*.experts.*.w1
"""
FP8_GOOD = GOOD.replace("}\n", FP8_LINES + "}\n")


def fp8_hf_text(
    tensors: dict[str, tuple[list[int], str]] | None = None,
    **changes: tuple[list[int], str] | None,
) -> str:
    """The FP8 HF manifest (``tensors``, FP8_TENSORS by default) with some keys changed
    (keyword: the key with dots as underscores; None removes the key)."""
    table = dict(FP8_TENSORS if tensors is None else tensors)
    for name, value in changes.items():
        key = next(k for k in table if k.replace(".", "_") == name)
        if value is None:
            del table[key]
        else:
            table[key] = value
    return dump_hf_manifest(
        {
            "format": "shardspec-hf-manifest/1",
            "config": HF["config"],
            "tensors": {
                k: {"shape": shape, "dtype": dtype, "file": "model.safetensors"}
                for k, (shape, dtype) in table.items()
            },
        }
    )
