"""SS096 unused-stage-pattern: a `first`, `last` or split pattern that places no
parameter."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { pp: 2  dp_shard: * }\nfsdp dp_shard\n'
RULES = "param ** replicate\n"
MANIFEST = {
    "layers.0.mlp.weight": [8, 8],  # manifest line 3
    "layers.1.mlp.weight": [8, 8],
    "norm.weight": [8],
    "output.weight": [16, 8],
    "tok_embeddings.weight": [16, 8],  # line 7
}
GOOD = """\
pipeline pp {
    first tok_embeddings
    split layers.{layer}
    last norm, output
}
"""

CASES = [
    {
        "name": "a head the model lacks",
        "spec": HEAD + RULES + GOOD.replace("norm, output", "norm, output, lm_head"),
        "manifest": MANIFEST,
        "expect": [
            (
                "SS096",
                8,
                "last pattern 'lm_head' places no parameter",
                "lm_head",
                "patterns are module prefixes of the manifest's names",
            )
        ],
    },
    {
        "name": "embeddings misnamed, so they lie nowhere",
        "spec": HEAD + RULES + GOOD.replace("tok_embeddings", "embed"),
        "manifest": MANIFEST,
        "expect": [
            ("SS096", 6, "first pattern 'embed' places no parameter", "embed"),
            ("SS091", "m.json:7", "on no pipeline stage: tok_embeddings.weight"),
        ],
    },
    {
        "name": "a whole parameter name is no module prefix",
        "spec": HEAD + RULES + GOOD.replace("norm, output", "norm.weight.*, output"),
        "manifest": MANIFEST,
        "expect": [
            ("SS096", 8, "last pattern 'norm.weight.*' places no parameter", "norm.weight.*"),
            ("SS091", "m.json:5", "on no pipeline stage: norm.weight"),
        ],
    },
    {
        "name": "a split of a family the model lacks",
        "spec": HEAD
        + RULES
        + GOOD.replace("first tok_embeddings", "first tok_embeddings, layers").replace(
            "layers.{layer}", "blocks.{layer}"
        ),
        "manifest": MANIFEST,
        "expect": [("SS096", 7, "split pattern 'blocks.{layer}' places no parameter", "blocks")],
    },
    {
        "name": "every pattern places something",
        "spec": HEAD + RULES + GOOD,
        "manifest": MANIFEST,
        "expect": [],
    },
]
