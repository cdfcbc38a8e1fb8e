"""SS037 tied-parameter-sharded: a parameter that is one tensor under two names (the
manifest's `tied_to`) is sharded over a model-parallel axis of size > 1."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
MANIFEST = {"embed.weight": [16, 8], "head.weight": [16, 8], "norm.weight": [8]}
MODULES = {"embed.weight": "embedding", "head.weight": "linear", "norm.weight": "RMSNorm"}
TIED = {"head.weight": {"tied_to": "embed.weight"}}
SHARDED = (
    "param embed.weight [vocab, hidden] {\n    shard vocab over tp\n}\n"
    "param head.weight [vocab, hidden] {\n    shard vocab over tp\n"
    "    style colwise output replicate\n}\n"
    "param norm.weight [hidden] {}\n"
)
PIPELINE = (
    'manifest "m.json"\nmesh over 8 ranks { pp: 2  dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
    "pipeline pp {\n    first embed\n    split layers.{layer}\n    last norm, head\n}\n"
    "param layers.*.w.weight [out, hidden] {}\n"
)

CASES = [
    {
        "name": "a tied embedding and head sharded over tp",
        "spec": HEAD + SHARDED,
        "manifest": MANIFEST,
        "modules": MODULES,
        "fields": TIED,
        "expect": [
            (
                "SS037",
                4,
                "head.weight is tied to embed.weight (one tensor used by two modules), and "
                "embed.weight is sharded over tp (size 2): torch's styles cut the weight for "
                "each module apart, which parts the tie, so parallelize refuses the model",
                "embed.weight",
                "keep the tied weight replicated over tp (`replicate tp`)",
            )
        ],
    },
    {
        "name": "the tied head ignored (GPT-2's spec), the embedding sharded",
        "spec": HEAD
        + "ignore head.weight\n"
        + "param embed.weight [vocab, hidden] {\n    shard vocab over tp\n}\n"
        + "param norm.weight [hidden] {}\n",
        "manifest": MANIFEST,
        "modules": MODULES,
        "fields": TIED,
        "expect": [("SS037", 5, "head.weight is tied to embed.weight", "embed.weight")],
    },
    {
        "name": "a tied weight replicated over tp",
        "spec": HEAD
        + "param {embed,head}.weight [vocab, hidden] {\n    replicate tp\n}\n"
        + "param norm.weight [hidden] {}\n",
        "manifest": MANIFEST,
        "modules": MODULES,
        "fields": TIED,
        "expect": [],
    },
    {
        "name": "tp of size 1",
        "spec": HEAD + SHARDED,
        "manifest": MANIFEST,
        "modules": MODULES,
        "fields": TIED,
        "args": ["-D", "tp=1"],
        "expect": [],
    },
    {
        "name": "untied weights sharded over tp",
        "spec": HEAD + SHARDED,
        "manifest": MANIFEST,
        "modules": MODULES,
        "expect": [],
    },
    {
        "name": "the embedding and the head on different pipeline stages",
        "spec": PIPELINE + SHARDED,
        "manifest": {**MANIFEST, "layers.0.w.weight": [8, 8], "layers.1.w.weight": [8, 8]},
        "modules": MODULES,
        "fields": TIED,
        "expect": [],
    },
    {
        "name": "one pipeline stage holds both",
        "spec": PIPELINE + SHARDED,
        "manifest": {**MANIFEST, "layers.0.w.weight": [8, 8], "layers.1.w.weight": [8, 8]},
        "modules": MODULES,
        "fields": TIED,
        "args": ["-D", "pp=1"],
        "expect": [("SS037", 10, "head.weight is tied to embed.weight", "embed.weight")],
    },
]
