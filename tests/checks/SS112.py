"""SS112 hf-quant-scale: an FP8 weight's scale is missing, of the wrong dtype or shape, or
read as something else."""

from tests.checks.hf_model import FP8_GOOD, FP8_TENSORS, HEAD, MANIFEST, fp8_hf_text

SPEC = HEAD + FP8_GOOD


def line_12(text: str) -> str:
    """The spec with the second fp8 line (line 12) written as ``text``."""
    return SPEC.replace("    fp8 model.layers.*.up\n", f"    {text}\n")


CASES = [
    {
        "name": "a missing scale",
        "spec": SPEC,
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(model_layers_1_up_scale_inv=None),
        "expect": [
            (
                "SS112",
                12,
                "FP8 key 'model.layers.1.up' has no scale 'model.layers.1.up_scale_inv' in "
                "the HF manifest",
                "model.layers.*.up",
                "`scale {key}_scale_inv`",
            )
        ],
    },
    {
        "name": "scales under another name",
        "spec": SPEC,
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(
            {
                (k.replace("_scale_inv", "_scale") if k.startswith("model.layers.0.up") else k): v
                for k, v in FP8_TENSORS.items()
            }
        ),
        "expect": [
            # one finding names the scale the checkpoint holds; no SS073 for it too
            (
                "SS112",
                12,
                "FP8 key 'model.layers.0.up' has no scale 'model.layers.0.up_scale_inv' in "
                "the HF manifest, which holds 'model.layers.0.up_scale'",
                "model",
                "`scale {key}_scale`",
            ),
        ],
    },
    {
        "name": "a template with a typo: one finding, not an SS073 per scale",
        "spec": line_12("fp8 model.layers.*.up scale {key}_scal_inv"),
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(),
        "expect": [
            (
                "SS112",
                12,
                "FP8 key 'model.layers.0.up' (and 1 more) has no scale "
                "'model.layers.0.up_scal_inv' in the HF manifest, which holds "
                "'model.layers.0.up_scale_inv'",
                "scale",
                "`scale {key}_scale_inv`",
            ),
        ],
    },
    {
        "name": "bf16 scales on a bfloat16 line (Qwen3's FP8 releases)",
        "spec": line_12("fp8 model.layers.*.up bfloat16"),
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(
            model_layers_0_up_scale_inv=([1, 1], "BF16"),
            model_layers_1_up_scale_inv=([1, 1], "BF16"),
        ),
        "expect": [],
    },
    {
        "name": "f32 scales on a float16 line",
        "spec": line_12("fp8 model.layers.*.up float16"),
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(model_layers_1_up_scale_inv=([1, 1], "F16")),
        "expect": [
            (
                "SS112",
                12,
                "scale 'model.layers.0.up_scale_inv' (of 'model.layers.0.up') is F32; line "
                "12's float16 scales are F16",
                "model",
                "write `float32` on the fp8 line for F32 scales",
            )
        ],
    },
    {
        "name": "a bf16 scale",
        "spec": SPEC,
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(model_layers_0_gate_scale_inv=([1, 1], "BF16")),
        "expect": [
            (
                "SS112",
                11,
                "scale 'model.layers.0.gate_scale_inv' (of 'model.layers.0.gate') is BF16; "
                "line 11's float32 scales are F32",
                "model",
                "write `bfloat16` on the fp8 line for BF16 scales",
            )
        ],
    },
    {
        "name": "an E8M0 scale without ue8m0",
        "spec": SPEC,
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(model_layers_0_up_scale_inv=([1, 1], "F8_E8M0")),
        "expect": [("SS112", 12, "is F8_E8M0; line 12's float32 scales are F32", "", "`ue8m0`")],
    },
    {
        "name": "a scale per 2 x 4 block: the wrong shape",
        "spec": line_12("fp8 model.layers.*.up block 2 x 4"),
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(),
        "expect": [
            (
                "SS112",
                12,
                "scale 'model.layers.0.up_scale_inv' (of 'model.layers.0.up' (and 1 more)) has "
                "shape [1, 1]; a 2 x 4 block scale of a [4, 8] weight is [2, 2]",
                "model",
            )
        ],
    },
    {
        "name": "a glob that matches the scales too",
        "spec": line_12("fp8 model.layers.*.up*"),
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(),
        "expect": [
            (
                "SS112",
                12,
                "fp8 'model.layers.*.up*' matches scale key 'model.layers.0.up_scale_inv' (and "
                "1 more) as a weight",
            )
        ],
    },
    {
        "name": "a map line that reads the scales",
        "spec": SPEC.replace(
            "    model.norm.weight -> norm.weight\n",
            "    model.norm.weight -> norm.weight\n"
            "    model.layers.{i}.gate_scale_inv -> layers.{i}.w13.gate\n",
        ).replace("    model.layers.{i}.gate -> layers.{i}.w13.gate\n", ""),
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(),
        "expect": [
            (
                "SS112",
                8,
                "scale 'model.layers.0.gate_scale_inv' (and 1 more) of an FP8 weight is read "
                "by map line 8 too",
                "model.layers.{i}.gate_scale_inv",
            ),
            ("SS073", "hf.json:8", "unexpected HF key 'model.layers.0.gate'"),
            ("SS075", 8, "HF key 'model.layers.0.gate_scale_inv' (and 1 more) has shape [1, 1]"),
        ],
    },
    {
        "name": "power-of-two scales stored as E8M0, per 2 x 4 block",
        "spec": line_12("fp8 model.layers.*.up block 2 x 4 ue8m0"),
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(
            model_layers_0_up_scale_inv=([2, 2], "F8_E8M0"),
            model_layers_1_up_scale_inv=([2, 2], "F32"),
        ),
        "expect": [],
    },
    {
        "name": "stacked experts: a scale per expert",
        "spec": HEAD
        + FP8_GOOD.replace(
            "    model.layers.{i}.experts.{e}.w1 -> layers.{i}.experts[e]\n",
            "    model.layers.{i}.experts.w1 -> layers.{i}.experts\n",
        ).replace("experts.*.w1", "experts.w1"),
        "manifest": MANIFEST,
        "hf_manifest_text": fp8_hf_text(
            {
                **{k: v for k, v in FP8_TENSORS.items() if ".experts." not in k},
                "model.layers.0.experts.w1": ([2, 4, 8], "F8_E4M3"),
                "model.layers.0.experts.w1_scale_inv": ([2, 1, 1], "F32"),
            }
        ),
        "expect": [],
    },
]
