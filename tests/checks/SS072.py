"""SS072 hf-unit-produced-twice: two map lines produce the same storage unit."""

from tests.checks.hf_model import GOOD, HEAD, HF, MANIFEST

CASES = [
    {
        "name": "two names for the norm",
        "spec": HEAD + GOOD.replace("}\n", "    model.final_norm.weight -> norm.weight\n}\n"),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [
            (
                "SS072",
                11,
                "storage unit 'norm.weight' is produced by 2 map lines (lines 7, 11)",
                "norm.weight",
            )
        ],
    },
    {
        "name": "a line splitting the fused tensor, and lines for its components too",
        "spec": HEAD + GOOD.replace("}\n", "    model.layers.{i}.w13 -> layers.{i}.w13\n}\n"),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [
            (
                "SS072",
                11,
                "storage unit 'layers.0.w13.gate' (and 1 more) is produced by 2 map lines "
                "(lines 8, 11)",
                "layers.{i}.w13",
            ),
            ("SS072", 11, "storage unit 'layers.0.w13.up' (and 1 more)"),
        ],
    },
    {
        "name": "one name for the norm",
        "spec": HEAD + GOOD,
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [],
    },
]
