"""SS083 hf-grouped-without-groups: `grouped` on a split line whose fused parameter
declares no groups."""

from tests.checks.SS082 import GROUPS, HF, MANIFEST, OWN, spec

CASES = [
    {
        "name": "grouped, but the fused dimension has no groups",
        "spec": spec("gate 4, up 4", OWN + " grouped"),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [
            (
                "SS083",
                7,
                "line 7 reads its Hugging Face tensor group by group, but the fused dimension "
                "of 'layers.0.w13' declares no groups",
                "grouped",
                "declare the model's groups: `fuse ffn as N groups of ...`",
            ),
        ],
    },
    {
        "name": "grouped, with groups",
        "spec": spec(GROUPS, OWN + " grouped"),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [],
    },
]
