"""SS071 hf-unit-not-produced: a storage unit that no map line produces and no keep
covers."""

from tests.checks.hf_model import GOOD, HEAD, HF, MANIFEST, TENSORS

# The checkpoint stores each layer's gate and up fused, as model.layers.N.w13.
FUSED = {k: v for k, v in TENSORS.items() if not k.endswith((".gate", ".up"))}
FUSED |= {f"model.layers.{i}.w13": [8, 8] for i in (0, 1)}
LINES = (
    "    model.layers.{i}.gate -> layers.{i}.w13.gate\n"
    "    model.layers.{i}.up -> layers.{i}.w13.up\n"
)

CASES = [
    {
        "name": "up component of the fused w13 is not mapped",
        "spec": HEAD + GOOD.replace("    model.layers.{i}.up -> layers.{i}.w13.up\n", ""),
        "manifest": MANIFEST,
        "hf_manifest": {**HF, "tensors": {k: v for k, v in TENSORS.items() if "up" not in k}},
        "expect": [
            (
                "SS071",
                "m.json:4",
                "storage unit 'layers.0.w13.up' [4, 8] is produced by no hf map line "
                "(and 1 more like it)",
                '"layers.0.w13"',
                "`keep` it",
            )
        ],
    },
    {
        "name": "kept",
        "spec": HEAD
        + GOOD.replace("    model.layers.{i}.up -> layers.{i}.w13.up\n", "    keep **.up\n"),
        "manifest": MANIFEST,
        "hf_manifest": {**HF, "tensors": {k: v for k, v in TENSORS.items() if "up" not in k}},
        "expect": [],
    },
    {
        "name": "ignored parameters are no units",
        "spec": HEAD.replace("param norm.weight [hidden] {}", "ignore norm.weight")
        + GOOD.replace("    model.norm.weight -> norm.weight\n", ""),
        "manifest": MANIFEST,
        "hf_manifest": {**HF, "tensors": {k: v for k, v in TENSORS.items() if "norm" not in k}},
        "expect": [],
    },
    {
        "name": "the checkpoint has the fused tensor: the hint is the line that maps it",
        "spec": HEAD + GOOD.replace(LINES, ""),
        "manifest": MANIFEST,
        "hf_manifest": {**HF, "tensors": FUSED},
        "expect": [
            (
                "SS071",
                "m.json:4",
                f"storage unit 'layers.0.w13.{c}' [4, 8] is produced by no hf map line",
                '"layers.0.w13"',
                "the HF manifest has the fused tensor 'model.layers.0.w13' [8, 8]: map it "
                "whole, `model.layers.{i}.w13 -> layers.{i}.w13` (its parts are gate, up, in "
                "that order",
            )
            for c in ("gate", "up")
        ]
        + [
            (
                "SS073",
                "hf.json:6",
                "unexpected HF key 'model.layers.0.w13' (and 1 more",
                '"model.layers.0.w13"',
                "map it whole, `model.layers.{i}.w13 -> layers.{i}.w13`",
            )
        ],
    },
    {
        "name": "the line that maps the fused tensor",
        "spec": HEAD + GOOD.replace(LINES, "    model.layers.{i}.w13 -> layers.{i}.w13\n"),
        "manifest": MANIFEST,
        "hf_manifest": {**HF, "tensors": FUSED},
        "expect": [],
    },
]
