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
        "name": "every line matches",
        "spec": SPEC,
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(),
        "expect": [],
    },
]
