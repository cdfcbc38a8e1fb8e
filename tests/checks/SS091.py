"""SS091 no-stage: a parameter that no `first`, `last` or split pattern places. The
finding points at the first such entry in the manifest."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { pp: 2  dp_shard: * }\nfsdp dp_shard\n'
RULES = "ignore **._extra_state\nparam ** replicate\n"
MANIFEST = {
    "layers.0.mlp._extra_state": None,  # manifest line 3
    "layers.0.mlp.weight": [8, 8],  # line 4
    "layers.1.mlp.weight": [8, 8],  # line 5
    "norm.weight": [8],  # line 6
    "output.weight": [16, 8],  # line 7
    "tok_embeddings.weight": [16, 8],  # line 8
}

CASES = [
    {
        "name": "final norm and head forgotten",
        "spec": HEAD
        + RULES
        + """\
pipeline pp {
    first tok_embeddings
    split layers.{layer}
}
""",
        "manifest": MANIFEST,
        "expect": [
            (
                "SS091",
                "m.json:6",
                "2 parameter(s) on no pipeline stage: norm.weight, output.weight",
                '"norm.weight"',
                "add their modules to `first`, `last` or the split of `pipeline pp`",
            )
        ],
    },
    {
        "name": "no split: the layers lie nowhere",
        "spec": HEAD
        + RULES
        + """\
pipeline pp {
    first tok_embeddings
    last norm, output
}
""",
        "manifest": MANIFEST,
        "expect": [
            (
                "SS091",
                "m.json:4",
                "2 parameter(s) on no pipeline stage: layers.0.mlp.weight, layers.1.mlp.weight",
                '"layers.0.mlp.weight"',
            )
        ],
    },
    {
        "name": "every parameter placed; extra states need no stage",
        "spec": HEAD
        + RULES
        + """\
pipeline pp {
    first tok_embeddings
    split layers.{layer}
    last norm, output
}
""",
        "manifest": MANIFEST,
        "expect": [],
    },
]
