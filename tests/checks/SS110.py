"""SS110 bad-quant-item: an hf block's fp8 line is malformed."""

from tests.checks.hf_model import FP8_GOOD, HEAD, MANIFEST, fp8_hf_text

SPEC = HEAD + FP8_GOOD
HF_TEXT = fp8_hf_text()


def line_12(text: str) -> str:
    """The spec with the second fp8 line (line 12) written as ``text``."""
    return SPEC.replace("    fp8 model.layers.*.up\n", f"    {text}\n")


CASES = [
    {
        "name": "a scale template without {key}",
        "spec": line_12("fp8 model.layers.*.up scale up_scale_inv"),
        "manifest": MANIFEST,
        "hf_manifest_text": HF_TEXT,
        "expect": [
            (
                "SS110",
                12,
                "scale 'up_scale_inv': the scale template names the weight's key as `{key}`",
                "scale",
                "write `fp8 GLOB [scale {key}_scale_inv]",
            ),
            # (the scales the line meant: its finding's, not each an SS073 too)
        ],
    },
    {
        "name": "a scale template naming the weight itself",
        "spec": line_12("fp8 model.layers.*.up scale {key}"),
        "manifest": MANIFEST,
        "hf_manifest_text": HF_TEXT,
        "expect": [
            ("SS110", 12, "the scale cannot be the weight itself", "scale"),
        ],
    },
    {
        "name": "globs in the scale template",
        "spec": line_12("fp8 model.layers.*.up scale {key}_*"),
        "manifest": MANIFEST,
        "hf_manifest_text": HF_TEXT,
        "expect": [
            ("SS110", 12, "no `*` and no other `{...}`", "scale"),
        ],
    },
    {
        "name": "an option twice, and a block of no rows",
        "spec": line_12("fp8 model.layers.*.up e4m3 block 0 x 128 ue8m0 float32"),
        "manifest": MANIFEST,
        "hf_manifest_text": HF_TEXT,
        "expect": [
            ("SS110", 12, "block 0 x 128: a block has a row and a column at least", "block"),
            (
                "SS110",
                12,
                "the scale format (`float32`, `bfloat16`, `float16` or `ue8m0`) is given twice "
                "(first at column 46)",
                "float32",
            ),
        ],
    },
    {
        "name": "alternatives in the glob",
        "spec": line_12("fp8 model.layers.*.{up,down}"),
        "manifest": MANIFEST,
        "hf_manifest_text": HF_TEXT,
        "expect": [
            ("SS110", 12, "fp8 globs take `*` and `**` only", "model.layers.*.{up,down}"),
            # no line declares the up weights: the finding says so
            ("SS111", "hf.json:10", "HF key 'model.layers.0.up' (and 1 more) is F8_E4M3"),
            ("SS073", "hf.json:11", "unexpected HF key 'model.layers.0.up_scale_inv'"),
        ],
    },
    {
        "name": "one glob on two lines",
        "spec": line_12("fp8 model.layers.*.gate"),
        "manifest": MANIFEST,
        "hf_manifest_text": HF_TEXT,
        "expect": [
            ("SS110", 12, "fp8 'model.layers.*.gate' is declared on line 11 too", "model"),
            ("SS111", "hf.json:10", "HF key 'model.layers.0.up' (and 1 more) is F8_E4M3"),
            ("SS073", "hf.json:11", "unexpected HF key 'model.layers.0.up_scale_inv'"),
        ],
    },
    {
        "name": "every option, each once",
        "spec": line_12("fp8 model.layers.*.up scale {key}_scale_inv block 128 x 128 float32 e4m3"),
        "manifest": MANIFEST,
        "hf_manifest_text": HF_TEXT,
        "expect": [],
    },
    {
        "name": "without any manifest",
        "spec": "mesh over 2 ranks { tp: 2 }\n" + FP8_GOOD.replace('hf "hf.json" {', "hf {"),
        "expect": [("SS079", 2, "the hf block names no HF manifest")],
    },
]
