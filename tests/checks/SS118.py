"""SS118 unknown-pad-dimension: `pad NAME to M` names no dimension of the rules that place
the line's target, or one found at several indices there. A name that resolves pads the
dimension its index would (`pad vocab to 64` is `pad 0 to 64`; before a transpose, the HF
tensor's dimension that becomes it)."""

from tests.checks.pad_model import HF, manifest, spec

TRANSPOSED = {
    "config": HF["config"],
    "tensors": {"model.embed_tokens.weight": [8, 1000], "model.norm.weight": [8]},
}

CASES = [
    {
        "name": "pad vocab: the rule's dimension 0, as `pad 0 to 64`",
        "spec": spec(" pad vocab to 64"),
        "manifest": manifest(1024),
        "hf_manifest": HF,
        "expect": [],
    },
    {
        "name": "pad hidden pads dimension 1, which the model does not pad",
        "spec": spec(" pad hidden to 64"),
        "manifest": manifest(1024),
        "hf_manifest": HF,
        "expect": [
            ("SS132", 8, "dimension 1 has 8 in the model", "pad hidden"),
            ("SS075", 8, "has shape [1000, 8], line 8 expects [1024, 8]"),
        ],
    },
    {
        "name": "before a transpose: the HF tensor's dimension 1 becomes vocab",
        "spec": spec(" pad vocab to 64 transpose"),
        "manifest": manifest(1024),
        "hf_manifest": TRANSPOSED,
        "expect": [],
    },
    {
        "name": "a misspelt name",
        "spec": spec(" pad vocb to 64"),
        "manifest": manifest(1024),
        "hf_manifest": HF,
        "expect": [
            (
                "SS118",
                8,
                "pad: 'vocb' is no dimension of the rules that place this line's target",
                "vocb",
                "did you mean 'vocab'?",
            ),
        ],
    },
    {
        "name": "no rule places the target: every rule's dimensions, at several indices",
        "spec": spec(" pad hidden to 64").replace("-> tok.weight", "-> missing.weight"),
        "manifest": manifest(1024),
        "hf_manifest": HF,
        "expect": [
            (
                "SS118",
                8,
                "pad: dimension 'hidden' is at several indices in the rules that may place "
                "this line's target: 0 (line 6), 1 (line 3)",
                "hidden",
                "give the index instead (`pad 0 to ...`)",
            ),
            ("SS073", "hf.json:4", "no map line consumes it"),
            ("SS071", "m.json:4", "storage unit 'tok.weight' [1024, 8] is produced by no"),
            ("SS078", 8, "produces no storage unit"),
        ],
    },
]
