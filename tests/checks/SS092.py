"""SS092 stage-conflict: a parameter placed by two of `first`, `last` and the split. The
finding points at the pattern of the claim named last (in the order first, last, split)."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { pp: 2  dp_shard: * }\nfsdp dp_shard\n'
RULES = "param ** replicate\n"
MANIFEST = {
    "layers.0.mlp.weight": [8, 8],
    "layers.1.mlp.weight": [8, 8],
    "layers.2.mlp.weight": [8, 8],
    "layers.3.mlp.weight": [8, 8],
    "norm.weight": [8],
    "output.weight": [16, 8],
    "tok_embeddings.weight": [16, 8],
}

CASES = [
    {
        "name": "layer 0 in first and in the split",
        "spec": HEAD
        + RULES
        + """\
pipeline pp {
    first tok_embeddings, layers.0
    split layers.{layer}
    last norm, output
}
""",
        "manifest": MANIFEST,
        "expect": [
            (
                "SS092",
                7,
                "1 parameter(s) placed by both first and split: layers.0.mlp.weight",
                "layers.{layer}",
                "each parameter lives on exactly one stage",
            )
        ],
    },
    {
        "name": "norm in first and last, output everywhere",
        "spec": HEAD
        + RULES
        + """\
pipeline pp {
    first tok_embeddings, norm
    split layers.{layer}
    last norm, out*, layers.3.mlp
}
""",
        "manifest": MANIFEST,
        "expect": [
            ("SS092", 8, "placed by both first and last: norm.weight", "norm, out*"),
            # the split's pattern: the claims are named in the order first, last, split
            ("SS092", 7, "placed by both last and split: layers.3.mlp.weight", "layers.{layer}"),
        ],
    },
    {
        "name": "layer 0 on the first stage by an explicit count",
        "spec": HEAD
        + RULES
        + """\
pipeline pp {
    first tok_embeddings
    split layers.{layer} as 1, 3
    last norm, output
}
""",
        "manifest": MANIFEST,
        "expect": [],
    },
]

# Persistent buffers are placed by their module prefix, as parameters are.
CASES += [
    {
        "name": "a buffer placed by both first and last",
        "spec": HEAD
        + RULES
        + """\
pipeline pp {
    first tok_embeddings, rope
    split layers.{layer}
    last norm, output, rope
}
""",
        "manifest": MANIFEST,
        "buffers": {"rope.cache": [4]},
        "expect": [
            (
                "SS092",
                8,
                "1 buffer(s) placed by both first and last: rope.cache",
                "rope",
                "each buffer lives on exactly one stage",
            )
        ],
    },
    {
        "name": "a buffer on one stage, and one no pattern covers (every stage's)",
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
        "buffers": {"layers.1.mlp.bias": [8], "freqs_cis": [4]},
        "expect": [],
    },
]
