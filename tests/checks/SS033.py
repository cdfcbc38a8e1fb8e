"""SS033 no-tp-style: a parameter sharded over a model-parallel axis whose module is
neither a Linear nor an Embedding, with no style stated."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  ep: 2 }\nfsdp dp_shard\n'
MANIFEST = {"experts.w1": [8, 8, 8]}

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
                "derives for it (Experts is neither a Linear nor an Embedding)",
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
]
