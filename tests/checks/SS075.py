"""SS075 hf-shape-mismatch: an HF tensor's shape is not the one its line expects."""

from tests.checks.hf_model import GOOD, HEAD, HF, MANIFEST, TENSORS

CASES = [
    {
        "name": "a transposed HF tensor without transpose",
        "spec": HEAD + GOOD,
        "manifest": MANIFEST,
        "hf_manifest": {**HF, "tensors": {**TENSORS, "model.layers.0.up": [8, 4]}},
        "expect": [
            (
                "SS075",
                9,
                "HF key 'model.layers.0.up' has shape [8, 4], line 9 expects [4, 8]",
                "model.layers.{i}.up",
            )
        ],
    },
    {
        "name": "with transpose",
        "spec": HEAD + GOOD.replace("layers.{i}.w13.up\n", "layers.{i}.w13.up transpose\n"),
        "manifest": MANIFEST,
        "hf_manifest": {
            **HF,
            "tensors": {**TENSORS, "model.layers.0.up": [8, 4], "model.layers.1.up": [8, 4]},
        },
        "expect": [],
    },
]
