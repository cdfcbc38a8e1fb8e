"""SS113 hf-quant-dtype: a tensor an fp8 line covers is not stored in its FP8 dtype."""

from tests.checks.hf_model import FP8_GOOD, FP8_TENSORS, HEAD, MANIFEST, fp8_hf_text

SPEC = HEAD + FP8_GOOD

CASES = [
    {
        "name": "a glob that covers the bf16 norm",
        "spec": SPEC.replace("    fp8 model.layers.*.gate\n", "    fp8 model.**\n"),
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(model_norm_weight=([8], "BF16")),
        "expect": [
            (
                "SS113",
                11,
                "HF key 'model.norm.weight' is BF16 in the HF manifest, and line 11 declares "
                "it F8_E4M3",
                "model.**",
                "DeepSeek ships embeddings, norms, the router",
            ),
            # the glob covers the scales too
            ("SS112", 11, "fp8 'model.**' matches scale key"),
            # and every other key: the later lines apply to none, line 11 wins
            (
                "SS114",
                12,
                "fp8 'model.layers.*.up' declares no FP8 weight: every key it matches is "
                "declared by line 11 (`model.**`) first",
                "model",
                "move it above line 11",
            ),
            ("SS114", 13, "every key it matches is declared by line 11 (`model.**`) first"),
        ],
    },
    {
        "name": "e5m2 bytes for an e4m3 line",
        "spec": SPEC,
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(model_layers_1_gate=([4, 8], "F8_E5M2")),
        "expect": [
            (
                "SS113",
                11,
                "HF key 'model.layers.1.gate' is F8_E5M2 in the HF manifest, and line 11 "
                "declares it F8_E4M3",
                "model",
                "write `e5m2` on the line",
            )
        ],
    },
    {
        "name": "a 1-D FP8 tensor",
        "spec": SPEC.replace(
            "    fp8 model.layers.*.gate\n",
            "    fp8 model.layers.*.gate\n    fp8 model.norm.weight\n",
        ),
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(
            {
                **FP8_TENSORS,
                "model.norm.weight": ([8], "F8_E4M3"),
                "model.norm.weight_scale_inv": ([1], "F32"),
            }
        ),
        "expect": [
            (
                "SS113",
                12,
                "FP8 key 'model.norm.weight' has shape [8]: a block-scaled tensor has two "
                "dimensions at least",
                "model.norm",
                "`drop` it and `keep` its parameter",
            )
        ],
    },
    {
        "name": "e5m2 bytes for an e5m2 line",
        "spec": SPEC.replace("fp8 model.layers.*.gate\n", "fp8 model.layers.*.gate e5m2\n"),
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(
            model_layers_0_gate=([4, 8], "F8_E5M2"), model_layers_1_gate=([4, 8], "F8_E5M2")
        ),
        "expect": [],
    },
]
