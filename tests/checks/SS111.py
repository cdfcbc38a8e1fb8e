"""SS111 hf-quant-undeclared: the HF manifest stores a tensor in FP8 that no fp8 line
covers, is no scale of one, and is not dropped."""

from tests.checks.hf_model import FP8_GOOD, FP8_TENSORS, HEAD, MANIFEST, fp8_hf_text

SPEC = HEAD + FP8_GOOD
NO_UP = SPEC.replace("    fp8 model.layers.*.up\n", "")

CASES = [
    {
        "name": "FP8 weights no line declares",
        "spec": NO_UP,
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(),
        "expect": [
            (
                "SS111",
                "hf.json:10",
                "HF key 'model.layers.0.up' (and 1 more) is F8_E4M3, and no fp8 line declares it",
                '"model.layers.0.up"',
                "`fp8 model.layers.*.up`",
            ),
            # and their scales are nobody's
            ("SS073", "hf.json:11", "unexpected HF key 'model.layers.0.up_scale_inv'"),
        ],
    },
    {
        "name": "an E8M0 tensor that is no scale",
        "spec": SPEC,
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text({**FP8_TENSORS, "model.norm.weight": ([8], "F8_E8M0")}),
        "expect": [("SS111", "hf.json:16", "HF key 'model.norm.weight' is F8_E8M0")],
    },
    {
        "name": "dropped FP8 keys need no line",
        "spec": NO_UP.replace(
            "    fp8 model.layers.*.gate\n",
            "    fp8 model.layers.*.gate\n    drop model.layers.*.up_scale_inv\n",
        ),
        "manifest": MANIFEST,
        # the up weights stored in BF16, their FP8 copies' scales dropped
        "hf_manifest_text": fp8_hf_text(
            model_layers_0_up=([4, 8], "BF16"), model_layers_1_up=([4, 8], "BF16")
        ),
        "expect": [],
    },
    {
        "name": "an FP8 tie alias that no line reads needs no line (its source is read)",
        "spec": SPEC.replace(
            "    fp8 model.layers.*.gate\n",
            "    fp8 model.layers.*.gate\n    tie model.mtp.up = model.layers.0.up\n",
        ),
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text({**FP8_TENSORS, "model.mtp.up": ([4, 8], "F8_E4M3")}),
        "expect": [],
    },
    {
        "name": "every FP8 weight declared",
        "spec": SPEC,
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(),
        "expect": [],
    },
]
