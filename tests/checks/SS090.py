"""SS090 bad-pipeline: the pipeline block's axis is no mesh axis, is the FSDP axis or is
used by a rule; a pattern is malformed; the split captures other than one name or a
first/last pattern captures; a second split; or no manifest to place the names by."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { pp: 2  dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
RULES = "param ** replicate\n"
MANIFEST = {
    "layers.0.mlp.weight": [8, 8],
    "layers.1.mlp.weight": [8, 8],
    "norm.weight": [8],
    "output.weight": [16, 8],
    "tok_embeddings.weight": [16, 8],
}
GOOD = """\
pipeline pp {
    first tok_embeddings
    split layers.{layer}
    last norm, output
}
"""


def case(name: str, pipeline: str, expect: list, head: str = HEAD, rules: str = RULES) -> dict:
    return {"name": name, "spec": head + rules + pipeline, "manifest": MANIFEST, "expect": expect}


CASES = [
    case(
        "axis misspelt",
        GOOD.replace("pipeline pp", "pipeline ppp"),
        [("SS090", 5, "pipeline axis 'ppp' is not a mesh axis", "ppp {", "did you mean 'pp'?")],
    ),
    case(
        "axis not in the mesh at all",
        GOOD.replace("pipeline pp", "pipeline stage"),
        [("SS090", 5, "pipeline axis 'stage' is not a mesh axis", "stage", "declared: pp, dp")],
    ),
    case(
        "the fsdp axis",
        GOOD.replace("pipeline pp", "pipeline dp_shard"),
        [
            (
                "SS090",
                3,
                "'dp_shard' is both the pipeline axis and the FSDP axis",
                "dp_shard",
                "shard with FSDP over another axis",
            )
        ],
    ),
    case(
        "a rule shards over the pipeline axis",
        GOOD,
        [
            (
                "SS090",
                6,
                "rule 'output.weight' places its parameter over the pipeline axis 'pp'",
                "pp)",
                "rules say how within it",
            )
        ],
        rules=RULES + "param output.weight [vocab, hidden] {\n    shard vocab over (tp, pp)\n}\n",
    ),
    case(
        "a rule replicates over the pipeline axis",
        GOOD,
        [("SS090", 4, "rule 'norm.weight' places its parameter over the pipeline axis", "pp")],
        rules="param norm.weight [hidden] { replicate pp }\n" + RULES,
    ),
    case(
        "malformed last pattern",
        GOOD.replace("norm, output", "norm, out**put"),
        [
            (
                "SS090",
                8,
                "bad last pattern 'out**put': '**' must be a whole segment",
                "out**put",
                "`**` any number",
            )
        ],
    ),
    case(
        "split without a capture",
        GOOD.replace("layers.{layer}", "layers.*"),
        [
            (
                "SS090",
                7,
                "split pattern 'layers.*' has 0 captures",
                "layers.*",
                "capture the layer index once",
            )
        ],
    ),
    case(
        "split with two captures",
        GOOD.replace("layers.{layer}", "{family}.{layer}"),
        [("SS090", 7, "split pattern '{family}.{layer}' has 2 captures", "{family}.{layer}")],
    ),
    case(
        "first pattern with a capture",
        GOOD.replace("first tok_embeddings", "first {kind}_embeddings"),
        [
            (
                "SS090",
                6,
                "first pattern '{kind}_embeddings' captures a name",
                "{kind}_embeddings",
                "write `*` here",
            )
        ],
    ),
    case(
        "last pattern with a capture",
        GOOD.replace("last norm, output", "last norm, {head}"),
        [("SS090", 8, "last pattern '{head}' captures a name", "{head}", "only the split")],
    ),
    case(
        "a second split",
        GOOD.replace("    last", "    split blocks.{layer}\n    last"),
        [
            (
                "SS090",
                8,
                "the pipeline has more than one split",
                "split blocks.{layer}",
                "the first one is at line 7",
            )
        ],
    ),
    {
        "name": "no manifest",
        "spec": "mesh over 8 ranks { pp: 2  dp_shard: * }\nfsdp dp_shard\n" + RULES + GOOD,
        "expect": [
            (
                "SS090",
                4,
                "a pipeline needs a manifest",
                "pipeline pp {",
                'add `manifest "model.json"`',
            )
        ],
    },
    case("a sound pipeline block", GOOD, []),
    case(
        "wildcards without captures in first and last; tp used by rules",
        GOOD.replace("first tok_embeddings", "first tok_*").replace("norm, output", "*norm, out*"),
        [],
        rules="param output.weight [vocab, hidden] {\n    shard vocab over tp\n}\n" + RULES,
    ),
    case(
        "a tie of patterns",
        GOOD.replace("output\n}", "output\n    tie output.* = tok_embeddings.weight\n}"),
        [("SS090", 9, "tie names 'output.*', a pattern", "output.*", "write whole parameter")],
    ),
    case(
        "a weight tied to itself",
        GOOD.replace("output\n}", "output\n    tie output.weight = output.weight\n}"),
        [("SS090", 9, "'output.weight' is tied to itself", "tie output", "delete the tie")],
    ),
    case(
        "an alias tied twice",
        GOOD.replace(
            "output\n}",
            "output\n    tie output.weight = tok_embeddings.weight\n"
            "    tie output.weight = norm.weight\n}",
        ),
        [("SS090", 10, "'output.weight' is tied twice", "output.weight", "at line 9")],
    ),
    case(
        "a tie to an alias",
        GOOD.replace(
            "output\n}",
            "output\n    tie output.weight = tok_embeddings.weight\n"
            "    tie output.bias = output.weight\n}",
        ),
        [
            (
                "SS090",
                10,
                "the tie's source 'output.weight' is itself an alias",
                "output.weight",
                "tie output.bias to tok_embeddings.weight",
            )
        ],
    ),
]
