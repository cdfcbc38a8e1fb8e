"""SS078 unused-hf-item: a map line that produces no storage unit, a keep that matches
none, a drop that matches no key of the HF manifest."""

from tests.checks.hf_model import GOOD, HEAD, HF, MANIFEST, TENSORS

CASES = [
    {
        "name": "a target that is not a unit, a keep that matches nothing",
        "spec": HEAD
        + GOOD.replace("}\n", "    model.final.weight -> final_norm.weight\n    keep head.*\n}\n"),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [
            (
                "SS078",
                11,
                "map line model.final.weight -> final_norm.weight produces no storage unit",
                "final_norm.weight",
            ),
            ("SS078", 12, "keep 'head.*' matches no storage unit", "head.*"),
        ],
    },
    {
        "name": "a component the fused dimension does not have",
        "spec": HEAD + GOOD.replace("}\n", "    model.layers.{i}.w2 -> layers.{i}.w13.down\n}\n"),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [("SS078", 11, "produces no storage unit", "layers.{i}.w13.down")],
    },
    {
        "name": "every line produces something",
        "spec": HEAD + GOOD,
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [],
    },
    {
        "name": "a drop of a key the checkpoint lacks",
        "spec": HEAD + GOOD.replace("}\n", "    drop model.rotary.*\n}\n"),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [
            (
                "SS078",
                11,
                "drop 'model.rotary.*' matches no key of the HF manifest",
                "model.rotary.*",
                "check the pattern against the HF manifest's keys",
            )
        ],
    },
    {
        "name": "a drop of a key the checkpoint has",
        "spec": HEAD + GOOD.replace("}\n", "    drop model.rotary.*\n}\n"),
        "manifest": MANIFEST,
        "hf_manifest": {**HF, "tensors": {**TENSORS, "model.rotary.inv_freq": [4]}},
        "expect": [],
    },
]
