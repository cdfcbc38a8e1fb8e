"""SS032 tp-style-contradiction: a stated style contradicts the style the module's kind and
placements give."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
MANIFEST = {"embed.weight": [16, 8], "output.weight": [16, 8], "hc.fn": [16, 8]}
MODULES = {"embed.weight": "embedding", "output.weight": "linear", "hc.fn": "Head"}
REST = "param embed.weight [vocab, hidden] {}\nparam hc.fn [a, b] {}\n"

CASES = [
    {
        "name": "rowwise on a Linear sharded on its out dimension",
        "spec": HEAD
        + "param output.weight [vocab, hidden] {\n    shard vocab over tp\n    style rowwise\n}\n"
        + REST,
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [
            (
                "SS032",
                6,
                "style rowwise contradicts the placements: output.weight belongs to a linear "
                "sharded on 'vocab', which makes it colwise",
                "rowwise",
                "state `style colwise`",
            )
        ],
    },
    {
        "name": "colwise on an Embedding sharded on the vocabulary",
        "spec": HEAD
        + "param embed.weight [vocab, hidden] {\n    shard vocab over tp\n    style colwise\n}\n"
        + "param output.weight [vocab, hidden] {}\nparam hc.fn [a, b] {}\n",
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [("SS032", 6, "which makes it rowwise", "colwise")],
    },
    {
        "name": "colwise on a module that is neither",
        "spec": HEAD
        + "param hc.fn [a, b] {\n    shard a over tp\n    style colwise\n}\n"
        + "param embed.weight [vocab, hidden] {}\nparam output.weight [vocab, hidden] {}\n",
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [("SS032", 6, "no tensor-parallel style applies to hc.fn", "colwise")],
    },
    {
        "name": "styles that agree with the placements",
        "spec": HEAD
        + "param output.weight [vocab, hidden] {\n    shard vocab over tp\n"
        + "    style colwise output replicate\n}\n"
        + "param embed.weight [vocab, hidden] {\n    shard vocab over tp\n    style rowwise\n}\n"
        + "param hc.fn [a, b] {\n    shard a over tp\n    style none\n}\n",
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [],
    },
]
