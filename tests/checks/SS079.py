"""SS079 no-hf-manifest: the hf block names no HF manifest."""

from tests.checks.hf_model import GOOD, HEAD, HF, MANIFEST

CASES = [
    {
        "name": "no HF manifest",
        "spec": HEAD + GOOD.replace('hf "hf.json" {', "hf {"),
        "manifest": MANIFEST,
        "expect": [("SS079", 6, "the hf block names no HF manifest", "hf {")],
    },
    {
        "name": "with one",
        "spec": HEAD + GOOD,
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [],
    },
]
