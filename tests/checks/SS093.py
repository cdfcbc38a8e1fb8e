"""SS093 empty-stage: a pipeline stage that holds no parameter."""

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
        "name": "no layers and nothing first on stage 0",
        "spec": HEAD
        + RULES
        + """\
pipeline pp {
    split layers.{layer} as 0, 4
    last tok_embeddings, norm, output
}
""",
        "manifest": MANIFEST,
        "expect": [
            (
                "SS093",
                5,
                "stage 0 of 2 holds no parameter",
                "pipeline pp",
                "give every stage at least one layer",
            )
        ],
    },
    {
        "name": "no layers and nothing last on stage 1",
        "spec": HEAD
        + RULES
        + """\
pipeline pp {
    first tok_embeddings, norm, output
    split layers.{layer} as 4, 0
}
""",
        "manifest": MANIFEST,
        "expect": [("SS093", 5, "stage 1 of 2 holds no parameter", "pipeline pp")],
    },
    {
        "name": "no split: everything on the first stage",
        "spec": HEAD + RULES + "pipeline pp { first ** }\n",
        "manifest": MANIFEST,
        "expect": [("SS093", 5, "stage 1 of 2 holds no parameter", "pipeline pp")],
    },
    {
        "name": "no layers on stage 0, but the embeddings",
        "spec": HEAD
        + RULES
        + """\
pipeline pp {
    first tok_embeddings
    split layers.{layer} as 0, 4
    last norm, output
}
""",
        "manifest": MANIFEST,
        "expect": [],
    },
    {
        "name": "one stage holds everything",
        "spec": HEAD + RULES + "pipeline pp { first ** }\n",
        "manifest": MANIFEST,
        "args": ["-D", "pp=1"],
        "expect": [],
    },
]
