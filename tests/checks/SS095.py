"""SS095 stage-names: stage-local names that do not map back to global ones: a split
capture that is no layer number, or with `local` a layer number with leading zeros."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { pp: 2  dp_shard: * }\nfsdp dp_shard\n'
RULES = "param ** replicate\n"
BLOCKS = {"blocks.attn.weight": [8, 8], "blocks.mlp.weight": [8, 8]}


def layers(*names: str) -> dict:
    return {
        "tok_embeddings.weight": [16, 8],
        **{f"layers.{n}.mlp.weight": [8, 8] for n in names},
        "output.weight": [16, 8],
    }


PIPELINE = """\
pipeline pp {
    first tok_embeddings
    split layers.{layer}LOCAL
    last output
}
"""

CASES = [
    {
        "name": "blocks named by kind, not number",
        "spec": HEAD + RULES + "pipeline pp { split blocks.{kind} local }\n",
        "manifest": BLOCKS,
        "expect": [
            (
                "SS095",
                5,
                "split 'blocks.{kind}' captures 'attn', 'mlp', not layer numbers",
                "blocks.{kind}",
                "split a family indexed by whole numbers",
            )
        ],
    },
    {
        "name": "a capture of digits that are not ASCII",
        "spec": HEAD + RULES + PIPELINE.replace("LOCAL", ""),
        "manifest": layers("0", "\u00b2"),
        "expect": [("SS095", 7, "captures '\u00b2', not layer numbers", "layers.{layer}")],
    },
    {
        "name": "zero-padded layers with local names",
        "spec": HEAD + RULES + PIPELINE.replace("LOCAL", " local"),
        "manifest": layers("00", "01", "02", "03"),
        "expect": [
            (
                "SS095",
                7,
                "stage-local names cannot map layer '00' back",
                "layers.{layer} local",
                "drop `local`, or name the layers 0, 1, 2, ...",
            )
        ],
    },
    {
        "name": "zero-padded layers with global names",
        "spec": HEAD + RULES + PIPELINE.replace("LOCAL", ""),
        "manifest": layers("00", "01", "02", "03"),
        "expect": [],
    },
    {
        "name": "plain layer numbers with local names",
        "spec": HEAD + RULES + PIPELINE.replace("LOCAL", " local"),
        "manifest": layers("0", "1", "2", "10"),
        "expect": [],
    },
]
