"""SS074 hf-missing-key: a key a unit needs is not in the HF manifest."""

from tests.checks.hf_model import GOOD, HEAD, HF, MANIFEST

CASES = [
    {
        "name": "the HF name is misspelt",
        "spec": HEAD + GOOD.replace("model.layers.{i}.gate ->", "model.layers.{i}.gate_proj ->"),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [
            (
                "SS074",
                8,
                "HF key 'model.layers.0.gate_proj' (and 1 more) that line 8 needs is not in the "
                "HF manifest",
                "model.layers.{i}.gate_proj",
            ),
            ("SS073", "hf.json:6", "unexpected HF key 'model.layers.0.gate' (and 1 more"),
        ],
    },
    {
        "name": "an absent key whose tie source is there",
        "spec": HEAD
        + GOOD.replace("model.norm.weight -> norm", "lm.weight -> norm").replace(
            "}\n", "    tie lm.weight = model.norm.weight\n}\n"
        ),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [],
    },
    {
        "name": "an absent key whose tie source is absent too",
        "spec": HEAD
        + GOOD.replace("model.norm.weight -> norm", "lm.weight -> norm").replace(
            "}\n", "    tie lm.weight = model.final_norm.weight\n    drop model.norm.*\n}\n"
        ),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [("SS074", 7, "HF key 'lm.weight' that line 7 needs", "lm.weight")],
    },
]
