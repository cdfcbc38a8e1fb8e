"""SS076 hf-transform-invalid: a transform that does not fit the unit's shape."""

from tests.checks.hf_model import GOOD, HEAD, HF, MANIFEST

CASES = [
    {
        "name": "transpose of a 1-D norm, rope on rows that are no whole heads",
        "spec": HEAD
        + GOOD.replace("-> norm.weight", "-> norm.weight transpose").replace(
            "layers.{i}.w13.gate", "layers.{i}.w13.gate rope 8"
        ),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [
            (
                "SS076",
                7,
                "'norm.weight': transpose needs a 2-D tensor, this one has shape [8]",
                "transpose",
            ),
            (
                "SS076",
                8,
                "'layers.0.w13.gate' (and 1 more): rope 8: dimension 0 has 4 rows",
                "rope 8",
            ),
        ],
    },
    {
        "name": "rope on whole heads",
        "spec": HEAD + GOOD.replace("layers.{i}.w13.gate", "layers.{i}.w13.gate rope 4"),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [],
    },
]
