"""SS097 bad-tie: a pipeline tie that does not fit the manifest: the source is no
parameter, the alias is a parameter of its own (a manifest that records `tied_to` may list
it tied to the source, and to nothing else), one of them is in the split family, or the
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


# `shardspec manifest` lists a tied weight under both names, the later one with `tied_to`
# the first (as transformers ties a head to its embedding).
LISTED = {"output.weight": {"tied_to": "tok_embeddings.weight"}}


def case(
    name: str, pipeline: str, expect: list, manifest: dict = TIED, fields: dict | None = None
) -> dict:
    out = {"name": name, "spec": HEAD + RULES + pipeline, "manifest": manifest, "expect": expect}
    return out | ({"fields": fields} if fields else {})


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
    case("the manifest lists the alias, tied to the source", GOOD, [], UNTIED, LISTED),
    case(
        "the manifest ties the alias to another tensor",
        GOOD.replace("last norm, output", "last norm, output, head2"),
        [
            (
                "SS097",
                9,
                "the tie's alias 'output.weight' is tied to 'head2.weight' in the manifest, not "
                "to 'tok_embeddings.weight'",
                "output.weight",
                "`tie output.weight = head2.weight`",
            )
        ],
        {**UNTIED, "head2.weight": [16, 8]},
        {"output.weight": {"tied_to": "head2.weight"}},
    ),
    case(
        "the manifest ties them the other way round",
        GOOD,
        [
            (
                "SS097",
                9,
                "the manifest ties 'tok_embeddings.weight' to 'output.weight': the whole model "
                "holds the tensor under 'output.weight'",
                "output.weight",
                "swap the names: `tie tok_embeddings.weight = output.weight`",
            )
        ],
        UNTIED,
        {"tok_embeddings.weight": {"tied_to": "output.weight"}},
    ),
    case(
        "a tie within the first stage",
        GOOD.replace("last norm, output", "last norm\n    first output"),
        [],
    ),
]
