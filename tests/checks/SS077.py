"""SS077 hf-config-mismatch: a config binding that names nothing, a key config.json lacks,
or a size that disagrees with the model's."""

from tests.checks.hf_model import GOOD, HEAD, HF, MANIFEST

CASES = [
    {
        "name": "wrong key, missing key, unknown name, not a number",
        "spec": HEAD
        + GOOD.replace(
            "}\n",
            "    config hidden = intermediate_size\n    config ffn = intermediate_sizes\n"
            "    config vocab = vocab_size\n    config gate = act\n}\n",
        ),
        "manifest": MANIFEST,
        "hf_manifest": {**HF, "config": {**HF["config"], "act": "silu"}},
        "expect": [
            (
                "SS077",
                11,
                "config hidden = intermediate_size = 4, but 'layers.0.experts' (and 3 more) has "
                "hidden of 8",
                "config hidden",
            ),
            ("SS077", 12, "config.json has no key 'intermediate_sizes'", "intermediate_sizes"),
            ("SS077", 13, "config 'vocab' names no dimension or fused component", "vocab"),
            ("SS077", 14, "config.json's 'act' is 'silu', not a whole number", "act"),
        ],
    },
    {
        "name": "dims and components that agree",
        "spec": HEAD
        + GOOD.replace(
            "}\n",
            "    config hidden = hidden_size\n    config gate = intermediate_size\n"
            "    config expert = num_experts * 1\n}\n",
        ),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [],
    },
]
