"""SS097 bad-tie: a pipeline tie that does not fit the manifest: the source is no
parameter, the alias is a parameter of its own, one of them is in the split family, or the
alias is on no stage (or on two)."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { pp: 2  dp_shard: * }\nfsdp dp_shard\n'
RULES = "param ** replicate\n"
TIED = {  # a tied model: named_parameters() lists the embedding once
    "layers.0.mlp.weight": [8, 8],
    "layers.1.mlp.weight": [8, 8],
    "norm.weight": [8],
    "tok_embeddings.weight": [16, 8],
}
UNTIED = {**TIED, "output.weight": [16, 8]}
GOOD = """\
pipeline pp {
    first tok_embeddings
    split layers.{layer}
    last norm, output
    tie output.weight = tok_embeddings.weight
}
"""


def case(name: str, pipeline: str, expect: list, manifest: dict = TIED) -> dict:
    return {"name": name, "spec": HEAD + RULES + pipeline, "manifest": manifest, "expect": expect}


CASES = [
    case(
        "the source misspelt",
        GOOD.replace("= tok_embeddings.weight", "= embed.weight"),
        [
            (
                "SS097",
                9,
                "the tie's source 'embed.weight' is not a parameter of the manifest",
                "embed.weight",
                "the name the whole model holds the tied weight under",
            )
        ],
    ),
    case(
        "the model does not tie them",
        GOOD,
        [
            (
                "SS097",
                9,
                "the tie's alias 'output.weight' is a parameter of its own in the manifest",
                "output.weight",
                "tie the weights in the model",
            )
        ],
        UNTIED,
    ),
    case(
        "the alias in the split family",
        GOOD.replace("tie output.weight", "tie layers.1.mlp.out"),
        [
            (
                "SS097",
                9,
                "the tie's alias 'layers.1.mlp.out' is in the split family",
                "layers.1.mlp.out",
                "place them with `first` or `last`",
            ),
            ("SS096", 8, "last pattern 'output' places no parameter", "output"),
        ],
    ),
    case(
        "the alias on no stage",
        GOOD.replace("last norm, output", "last norm"),
        [
            (
                "SS097",
                9,
                "the tie's alias 'output.weight' is on no pipeline stage",
                "output.weight",
                "e.g. `last output`",
            )
        ],
    ),
    case(
        "the alias on two stages",
        GOOD.replace("first tok_embeddings", "first tok_embeddings, output"),
        [
            (
                "SS097",
                9,
                "the tie's alias 'output.weight' is placed by both first and last",
                "output.weight",
            )
        ],
    ),
    case("a tie the manifest holds", GOOD, []),
    case(
        "a tie within the first stage",
        GOOD.replace("last norm, output", "last norm\n    first output"),
        [],
    ),
]
