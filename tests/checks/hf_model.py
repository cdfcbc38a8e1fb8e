"""The small model, HF checkpoint and hf block that the SS07x cases share."""

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
