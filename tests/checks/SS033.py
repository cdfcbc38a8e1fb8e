"""SS033 no-tp-style: a parameter sharded over a model-parallel axis whose module is
neither a Linear, an Embedding nor transformers' Conv1D, with no style stated."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  ep: 2 }\nfsdp dp_shard\n'
MANIFEST = {"experts.w1": [8, 8, 8]}
TP_HEAD = 'manifest "m.json"\nmesh over 4 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
CONV1D = {"h.c_fc.weight": [8, 16], "h.c_fc.bias": [16]}

CASES = [
    {
        "name": "stacked experts on ep",
        "spec": HEAD + "param experts.w1 [expert, ffn, hidden] {\n    shard expert over ep\n}\n",
        "manifest": MANIFEST,
        "modules": {"experts.w1": "Experts"},
        "expect": [
            (
                "SS033",
                4,
                "experts.w1 is sharded over a model-parallel axis, but no tensor-parallel style "
                "derives for it (Experts is neither a Linear, an Embedding nor transformers' "
                "Conv1D)",
                "experts.w1",
                "state `style none`",
            )
        ],
    },
    {
        "name": "a manifest without module kinds (not checked by lint)",
        "spec": HEAD + "param experts.w1 [expert, ffn, hidden] {\n    shard expert over ep\n}\n",
        "manifest": MANIFEST,
        "expect": [],  # an older manifest: parallelize checks the module when it runs
    },
    {
        "name": "style none",
        "spec": HEAD
        + "param experts.w1 [expert, ffn, hidden] {\n    shard expert over ep\n    style none\n}\n",
        "manifest": MANIFEST,
        "modules": {"experts.w1": "Experts"},
        "expect": [],
    },
    {
        "name": "transformers' Conv1D (weight [in, out]) cut on out: colwise derives",
        "spec": TP_HEAD + "param h.c_fc.weight [hidden, ffn] {\n    shard ffn over tp\n}\n"
        "param h.c_fc.bias [ffn] {\n    shard ffn over tp\n}\n",
        "manifest": CONV1D,
        "modules": {"h.c_fc.weight": "conv1d", "h.c_fc.bias": "conv1d"},
        "expect": [],
    },
    {
        "name": "an older manifest records Conv1D by its class name: rebuild it",
        "spec": TP_HEAD + "param h.c_fc.weight [hidden, ffn] {\n    shard ffn over tp\n}\n"
        "param h.c_fc.bias [ffn] {\n    shard ffn over tp\n}\n",
        "manifest": CONV1D,
        "modules": {"h.c_fc.weight": "Conv1D", "h.c_fc.bias": "Conv1D"},
        "expect": [
            (
                "SS033",
                4,
                "h.c_fc.weight is sharded over a model-parallel axis, but no tensor-parallel "
                "style derives for it (Conv1D is not transformers' own Conv1D to this manifest",
                "h.c_fc.weight",
                "state `style none`",
            ),
            ("SS033", 7, "h.c_fc.bias is sharded", "h.c_fc.bias", ""),
        ],
    },
]
