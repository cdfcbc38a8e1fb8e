"""SS114 unused-quant-item: an fp8 line matches no FP8 weight of the HF manifest."""

from tests.checks.hf_model import FP8_GOOD, HEAD, MANIFEST, fp8_hf_text

SPEC = HEAD + FP8_GOOD

CASES = [
    {
        "name": "a typo in the glob",
        "spec": SPEC.replace(
            "fp8 model.layers.*.up\n", "fp8 model.layers.*.up\n    fp8 model.layer.*.down\n"
        ),
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(),
        "expect": [
            (
                "SS114",
                13,
                "fp8 'model.layer.*.down' matches no FP8 weight of the HF manifest",
                "model.layer.*.down",
            )
        ],
    },
    {
        "name": "two fp8 lines on one spec line: each is tracked on its own",
        "spec": SPEC.replace(
            "fp8 model.layers.*.up\n", "fp8 model.layers.*.up  fp8 model.layer.*.down\n"
        ),
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(),
        "expect": [
            (
                "SS114",
                12,
                "fp8 'model.layer.*.down' matches no FP8 weight of the HF manifest",
                "model.layer.*.down",
            )
        ],
    },
    {
        "name": "a line an earlier glob shadows names the line that wins",
        "spec": SPEC.replace(
            "fp8 model.layers.*.up\n", "fp8 model.layers.**.up\n    fp8 model.layers.*.up e5m2\n"
        ),
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(),
        "expect": [
            (
                "SS114",
                13,
                "fp8 'model.layers.*.up' declares no FP8 weight: every key it matches is "
                "declared by line 12 (`model.layers.**.up`) first",
                "model.layers.*.up",
                "move it above line 12 (or narrow that line's glob)",
            ),
        ],
    },
    {
        "name": "every line matches",
        "spec": SPEC,
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(),
        "expect": [],
    },
]
