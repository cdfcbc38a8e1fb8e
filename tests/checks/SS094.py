"""SS094 stage-split: the layers do not split over the stages: an even split the pipeline
size does not divide, counts for another number of stages, counts that do not add up to
the layers, or more stages than layers."""

HEAD = 'manifest "m.json"\nmesh over 24 ranks { pp: PP  dp_shard: * }\nfsdp dp_shard\n'
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


def case(name: str, pp: int, split: str, expect: list, args: tuple[str, ...] = ()) -> dict:
    pipeline = f"pipeline pp {{\n    first tok_embeddings\n    {split}\n    last norm, output\n}}\n"
    return {
        "name": name,
        "spec": HEAD.replace("PP", str(pp)) + RULES + pipeline,
        "manifest": MANIFEST,
        "args": list(args),
        "expect": expect,
    }


CASES = [
    case(
        "4 layers over 3 stages, evenly",
        3,
        "split layers.{layer}",
        [
            (
                "SS094",
                7,
                "4 layers do not split evenly over 3 stages of 'pp'",
                "layers.{layer}",
                "give each stage's count, e.g. `split layers.{layer} as 1, 1, 2`",
            )
        ],
    ),
    case(
        "an even split that -D makes uneven",
        2,
        "split layers.{layer}",
        [("SS094", 7, "4 layers do not split evenly over 3 stages", "layers", "as 1, 1, 2")],
        ("-D", "pp=3"),
    ),
    case(
        "three counts for two stages",
        2,
        "split layers.{layer} as 1, 1, 2",
        [
            (
                "SS094",
                7,
                "the split gives 3 stage(s) layers (1, 1, 2), but 'pp' has 2 stage(s)",
                "as 1, 1, 2",
                "give one count per stage, or drop `as ...` for an even split of 4",
            )
        ],
    ),
    case(
        "counts that add up to 3 of 4 layers",
        2,
        "split layers.{layer} as 1, 2 local",
        [
            (
                "SS094",
                7,
                "the split's counts add up to 3 layers, but the model has 4",
                "as 1, 2",
                "the counts must add up to the number of layers",
            )
        ],
    ),
    case(
        "more stages than layers",
        8,
        "split layers.{layer}",
        [
            (
                "SS094",
                7,
                "4 layers cannot fill 8 stages of 'pp'",
                "layers.{layer}",
                "use at most 4 stages",
            )
        ],
    ),
    case("4 layers over 3 stages, counted", 3, "split layers.{layer} as 1, 1, 2", []),
    case("4 layers over 2 stages, evenly", 2, "split layers.{layer}", []),
    case("4 layers over 4 stages by -D", 2, "split layers.{layer}", [], ("-D", "pp=4")),
]
