"""SS082 hf-own-tensor-not-grouped: a split line reads the fused parameter's own Hugging Face
tensor (the model's own checkpoint) as components one after another, while the fused
dimension declares groups (gpt-oss's interleaved gate_up_proj; Phi3 declared with
Megatron's groups)."""

MANIFEST = {"layers.0.w13": [8, 8], "layers.1.w13": [8, 8], "norm.weight": [8]}
TENSORS = {"layers.0.w13": [8, 8], "layers.1.w13": [8, 8], "norm.weight": [8]}
HF = {"config": {}, "tensors": TENSORS}


def spec(fuse: str, line: str) -> str:
    """The w13 map line is line 7."""
    return (
        'manifest "m.json"\n'
        "mesh over 2 ranks { tp: 2 }\n"
        "param norm.weight [hidden] {}\n"
        f"param layers.*.w13 [ffn, hidden] {{ fuse ffn as {fuse} }}\n"
        'hf "hf.json" {\n'
        "    norm.weight -> norm.weight\n"
        f"    {line}\n"
        "}\n"
    )


GROUPS = "2 groups of gate 2, up 2"
OWN = "layers.{i}.w13 -> layers.{i}.w13"

CASES = [
    {
        "name": "the model's own tensor read as contiguous components",
        "spec": spec(GROUPS, OWN),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [
            (
                "SS082",
                7,
                "line 7 reads the Hugging Face tensor named as 'layers.0.w13' (the model's own) "
                "as gate 4, up 4 one after another, but the model holds 2 groups of gate 2, up 2",
                "layers.{i}.w13",
                "add `grouped` (`layers.{i}.w13 -> layers.{i}.w13 grouped`); if it holds the "
                "components one after another (Phi3's q|k|v), drop the groups: "
                "`fuse ffn as gate 4, up 4`",
            ),
        ],
    },
    {
        "name": "captures named differently, an as list in declared order",
        "spec": spec(GROUPS, "layers.{j}.w13 -> layers.{i}.w13 as gate, up".replace("{i}", "{j}")),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [("SS082", 7, "the model holds 2 groups of gate 2, up 2", "layers.{j}.w13")],
    },
    {
        "name": "grouped says the storage is the model's",
        "spec": spec(GROUPS, OWN + " grouped"),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [],
    },
    {
        "name": "no groups: the components one after another (Phi3)",
        "spec": spec("gate 4, up 4", OWN),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [],
    },
    {
        "name": "another checkpoint's name (Megatron's): not known to be the model's layout",
        "spec": spec(GROUPS, "model.layers.{i}.gate_up -> layers.{i}.w13"),
        "manifest": MANIFEST,
        "hf_manifest": {
            "config": {},
            "tensors": {
                "model.layers.0.gate_up": [8, 8],
                "model.layers.1.gate_up": [8, 8],
                "norm.weight": [8],
            },
        },
        "expect": [],
    },
    {
        "name": "transforms declare a storage of the line's own",
        "spec": spec(GROUPS, OWN + " transpose"),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [],
    },
]
