"""SS029 bad-tp-style: a `style` line with an unknown style or layout, a second one, layouts
on a style that takes none, or a style that does not fit the rule's placements."""

HEAD = "mesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n"

CASES = [
    {
        "name": "unknown style",
        "spec": HEAD + "param w [out, hidden] {\n    shard out over tp\n    style colwyse\n}\n",
        "expect": [("SS029", 5, "unknown style 'colwyse'", "colwyse", "did you mean 'colwise'?")],
    },
    {
        "name": "unknown layout",
        "spec": HEAD
        + "param w [out, hidden] {\n    shard out over tp\n    style colwise output full\n}\n",
        "expect": [("SS029", 5, "unknown activation layout 'full'", "full", "layouts:")],
    },
    {
        "name": "two style lines",
        "spec": HEAD
        + "param w [out, hidden] {\n    shard out over tp\n    style colwise\n"
        + "    style colwise\n}\n",
        "expect": [("SS029", 6, "a rule states one style", "style")],
    },
    {
        "name": "layouts on sequence parallelism",
        "spec": HEAD
        + "param norm.weight [hidden] {\n    style sequence_parallel output replicate\n}\n",
        "expect": [("SS029", 4, "style sequence_parallel takes no output layout", "replicate")],
    },
    {
        "name": "a token layout on sequence parallelism",
        "spec": HEAD
        + "param norm.weight [hidden] {\n    style sequence_parallel input features\n}\n",
        "expect": [
            (
                "SS029",
                4,
                "style sequence_parallel takes no input layout 'features'",
                "features",
                "`style sequence_parallel input heads` cuts per-head activations",
            )
        ],
    },
    {
        "name": "the heads layout on a colwise style",
        "spec": HEAD
        + "param w [out, hidden] {\n    shard out over tp\n    style colwise input heads\n}\n",
        "expect": [("SS029", 5, "unknown activation layout 'heads'", "heads", "layouts:")],
    },
    {
        "name": "sequence parallelism on a sharded parameter",
        "spec": HEAD
        + "param norm.weight [hidden] {\n    shard hidden over tp\n"
        + "    style sequence_parallel\n}\n",
        "expect": [("SS029", 5, "sequence parallelism needs the parameter replicated", "")],
    },
    {
        "name": "colwise with nothing sharded over tp",
        "spec": HEAD + "param w [out, hidden] {\n    style colwise\n}\n",
        "expect": [("SS029", 4, "style colwise: no dimension is sharded", "colwise")],
    },
    {
        "name": "colwise with two dimensions sharded over model-parallel axes",
        "spec": "mesh over 8 ranks { dp_shard: *  tp: 2  cp: 2 }\nfsdp dp_shard\n"
        + "param w [out, hidden] {\n    shard out over tp\n    shard hidden over cp\n"
        + "    style colwise\n}\n",
        "expect": [("SS029", 6, "style colwise: several dimensions are sharded", "colwise")],
    },
    {
        "name": "fitting styles",
        "spec": HEAD
        + "param w [out, hidden] {\n    shard out over tp\n    style colwise input sequence "
        + "output replicate dtensor\n}\n"
        + "param norm.weight [hidden] {\n    style sequence_parallel dtensor\n}\n"
        + "param q_norm.weight [head_dim] {\n    style sequence_parallel input heads\n}\n"
        + "param e [expert, hidden] {\n    shard expert over tp\n    style none\n}\n"
        + "param fsdp_only [out, hidden] {\n    shard hidden over tp\n    style rowwise\n}\n",
        "expect": [],
    },
]
