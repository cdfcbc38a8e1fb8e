"""SS080 hf-name-read-twice: two map lines read the same Hugging Face name."""

from tests.checks.hf_model import GOOD, HEAD, HF, MANIFEST, TENSORS

# A second fused parameter that a careless line maps from the same HF names.
TWICE = HEAD.replace(
    "param layers.*.experts",
    "param layers.*.w13b [ffn, hidden] { fuse ffn as gate, up }\nparam layers.*.experts",
)
MANIFEST2 = {**MANIFEST, "layers.0.w13b": [8, 8], "layers.1.w13b": [8, 8]}
UP2 = {f"model.layers.{i}.up2": [4, 8] for i in (0, 1)}
HF2 = {**HF, "tensors": {**TENSORS, **UP2}}
HF3 = {
    **HF,
    "tensors": {**TENSORS, **UP2, "model.layers.0.gate2": [4, 8], "model.layers.1.gate2": [4, 8]},
}
LINES = (
    "    model.layers.{j}.gate -> layers.{j}.w13b.gate\n"
    "    model.layers.{j}.up2 -> layers.{j}.w13b.up\n"
)

CASES = [
    {
        "name": "one HF name for two parameters, captures renamed",
        "spec": TWICE + GOOD.replace("}\n", LINES + "}\n"),
        "manifest": MANIFEST2,
        "hf_manifest": HF2,
        "expect": [
            (
                "SS080",
                12,
                "Hugging Face name 'model.layers.{j}.gate' is read by line 9 too",
                "model.layers.{j}.gate",
            ),
        ],
    },
    {
        "name": "each HF name read once",
        "spec": TWICE + GOOD.replace("}\n", LINES.replace("{j}.gate ->", "{j}.gate2 ->") + "}\n"),
        "manifest": MANIFEST2,
        "hf_manifest": HF3,
        "expect": [],
    },
]
