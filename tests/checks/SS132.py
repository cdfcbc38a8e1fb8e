"""SS132 pad-size-mismatch: the model's padded size is not the HF size rounded up to the
pad's multiple (or an axis the multiple names is no mesh axis). SS075's hint proposes the
pad line where a model dimension is larger than the HF one and the line has none."""

from tests.checks.pad_model import HF, manifest, spec

CASES = [
    {
        "name": "1000 rows padded to 48 would be 1008, the model has 1024",
        "spec": spec(" pad 0 to 48"),
        "manifest": manifest(1024),
        "hf_manifest": HF,
        "expect": [
            (
                "SS132",
                8,
                "tok.weight: dimension 0 has 1024 in the model, but the HF size 1000 padded "
                "to a multiple of 48 is 1008",
                "pad 0 to 48",
                "write `pad 0 to 64`",
            ),
        ],
    },
    {
        "name": "Megatron's rule names an axis that is not in the mesh",
        "spec": spec(" pad 0 to 64 x tpp"),
        "manifest": manifest(1024),
        "hf_manifest": HF,
        "expect": [("SS132", 8, "'tpp' is no mesh axis", "pad 0", "did you mean `tp`?")],
    },
    {
        "name": "Megatron's rule names tp twice",
        "spec": spec(" pad 0 to 64 x tp x tp"),
        "manifest": manifest(1024),
        "hf_manifest": HF,
        "expect": [
            ("SS132", 8, "names mesh axis 'tp' twice", "pad 0", "`pad 0 to 64 x tp`"),
        ],
    },
    {
        "name": "vLLM: 1000 rows padded to a multiple of 64",
        "spec": spec(" pad 0 to 64"),
        "manifest": manifest(1024),
        "hf_manifest": HF,
        "expect": [],
    },
    {
        "name": "Megatron: padded to 128 x tp",
        "spec": spec(" pad 0 to 128 x tp"),
        "manifest": manifest(1024),
        "hf_manifest": HF,
        "expect": [],
    },
    {
        "name": "no pad on a larger model dimension: SS075's hint proposes it",
        "spec": spec(""),
        "manifest": manifest(1024),
        "hf_manifest": HF,
        "expect": [
            (
                "SS075",
                8,
                "has shape [1000, 8], line 8 expects [1024, 8]",
                "model.embed_tokens.weight",
                "end the line with `pad 0 to 64`",
            ),
        ],
    },
    {
        "name": "a pad on a dimension the model does not pad",
        "spec": spec(" transpose pad 0 to 64 transpose"),
        "manifest": manifest(1024),
        "hf_manifest": HF,
        "expect": [
            ("SS075", 8, "has shape [1000, 8], line 8 expects [1024, 8]"),
            ("SS132", 8, "dimension 1 has 8 in the model", "pad 0 to 64", "delete the pad"),
        ],
    },
    {
        "name": "no HF manifest: the HF size is unknown",
        "spec": spec(" pad 0 to 64").replace('hf "hf.json" {', "hf {"),
        "manifest": manifest(1024),
        "expect": [
            ("SS079", 7, "the hf block names no HF manifest"),
            ("SS132", 8, "needs the HF size of the dimension it pads", "pad 0 to 64"),
        ],
    },
]
