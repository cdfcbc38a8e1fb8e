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
    {
        "name": "a column-parallel Linear whose bias is not cut",
        "spec": HEAD
        + "param q.weight [out, hidden] {\n    shard out over tp\n}\nparam q.bias [out] {}\n",
        "manifest": {"q.weight": [16, 8], "q.bias": [16]},
        "modules": {"q.weight": "linear", "q.bias": "linear"},
        "expect": [
            (
                "SS032",
                7,
                "q.bias is replicated over tp, but its Linear's weight is cut on its out "
                "dimension over tp",
                "q.bias",
                "`shard out over tp`",
            )
        ],
    },
    {
        "name": "a row-parallel Linear whose bias is cut",
        "spec": HEAD
        + "param q.weight [out, hidden] {\n    shard hidden over tp\n}\n"
        + "param q.bias [out] {\n    shard out over tp\n}\n",
        "manifest": {"q.weight": [16, 8], "q.bias": [16]},
        "modules": {"q.weight": "linear", "q.bias": "linear"},
        "expect": [("SS032", 7, "q.bias is sharded over tp", "q.bias", "no model-parallel")],
    },
    {
        "name": "biases cut like their weights",
        "spec": HEAD
        + "param q.weight [out, hidden] {\n    shard out over tp\n}\n"
        + "param q.bias [out] {\n    shard out over tp\n}\n"
        + "param o.weight [hidden, out] {\n    shard out over tp\n}\nparam o.bias [hidden] {}\n",
        "manifest": {"q.weight": [16, 8], "q.bias": [16], "o.weight": [8, 16], "o.bias": [8]},
        "modules": {n: "linear" for n in ("q.weight", "q.bias", "o.weight", "o.bias")},
        "expect": [],
    },
    {
        "name": "transformers' Conv1D [in, out] cut on out, stated rowwise",
        "spec": HEAD
        + "param c.weight [hidden, out] {\n    shard out over tp\n    style rowwise\n}\n",
        "manifest": {"c.weight": [8, 16]},
        "modules": {"c.weight": "conv1d"},
        "expect": [("SS032", 6, "belongs to a conv1d sharded on 'out', which makes it colwise")],
    },
    {
        "name": "a row-parallel Conv1D whose bias is cut",
        "spec": HEAD
        + "param c.weight [ffn, hidden] {\n    shard ffn over tp\n}\n"
        + "param c.bias [hidden] {\n    shard hidden over tp\n}\n",
        "manifest": {"c.weight": [16, 8], "c.bias": [8]},
        "modules": {"c.weight": "conv1d", "c.bias": "conv1d"},
        "expect": [("SS032", 7, "its Conv1D's weight is cut on its out", "c.bias", "no model")],
    },
    {
        "name": "a column-parallel Conv1D, bias cut like its weight's out (dim 1)",
        "spec": HEAD
        + "param c.weight [hidden, ffn] {\n    shard ffn over tp\n}\n"
        + "param c.bias [ffn] {\n    shard ffn over tp\n}\n",
        "manifest": {"c.weight": [8, 16], "c.bias": [16]},
        "modules": {"c.weight": "conv1d", "c.bias": "conv1d"},
        "expect": [],
    },
]
