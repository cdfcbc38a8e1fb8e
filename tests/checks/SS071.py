"""SS071 hf-unit-not-produced: a storage unit that no map line produces and no keep
covers."""

from tests.checks.hf_model import GOOD, HEAD, HF, MANIFEST, TENSORS

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
]
