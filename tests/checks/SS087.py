"""SS087 sharded-buffer: a rule shards a persistent buffer over a mesh axis at run time."""

import json

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
MANIFEST = {"attn.wq.weight": [8, 8], "attn.wo.weight": [8, 8]}
BUFFERS = {"rope.cache": [16, 8], "layers.0.router.bias": [4], "layers.1.router.bias": [4]}
RULES = "param attn.*.weight [out, in] {}\n"
# A format-1 manifest (built from state_dict()): a state-dict hook's key looks like a buffer.
LEGACY = json.dumps(
    {
        "format": "shardspec-manifest/1",
        "entries": [
            {"fqn": "layers.0.attention.wo.weight", "shape": [64, 64]},
            {"fqn": "layers.0.attention.wq.weight", "kind": "buffer", "shape": [64, 64]},
        ],
    }
)

CASES = [
    {
        "name": "the fsdp default shards a buffer",
        "spec": HEAD + RULES + "param rope.cache [a, b] {}\n",
        "manifest": MANIFEST,
        "buffers": BUFFERS,
        "expect": [
            (
                "SS087",
                5,
                "buffer 'rope.cache' is sharded over dp_shard (the fsdp default) by rule "
                "'rope.cache', but FSDP2 and torch's tensor-parallel styles keep buffers whole",
                "rope.cache",
                "write `param rope.cache [...] replicate` (whole on every rank, as a buffer no "
                "rule matches is), or `replicate dp_shard`",
            )
        ],
    },
    {
        "name": "a stated shard over tp, for every layer's buffer",
        "spec": HEAD + RULES + "param layers.*.router.bias [experts] { shard experts over tp }\n",
        "manifest": MANIFEST,
        "buffers": BUFFERS,
        "expect": [
            (
                "SS087",
                5,
                "buffer 'layers.0.router.bias' (and 1 more) is sharded over tp, dp_shard (the "
                "fsdp default) by rule 'layers.*.router.bias'",
            )
        ],
    },
    {
        "name": "a format-1 manifest: the hook's key looks like a buffer",
        "spec": HEAD + "param layers.*.attention.*.weight [out, in] {}\n",
        "manifest_text": LEGACY,
        "expect": [
            (
                "SS087",
                4,
                "buffer 'layers.0.attention.wq.weight' is sharded over dp_shard",
                "layers.*.attention.*.weight",
                "the manifest is of format 1, built from state_dict(), where a state-dict "
                "hook's key looks like a buffer: rebuild it with `shardspec manifest`",
            )
        ],
    },
    {
        "name": "buffers whole, replicated over fsdp, or split in checkpoints only",
        "spec": HEAD
        + RULES
        + """\
param rope.cache [a, b] { replicate dp_shard  checkpoint shard a over dp_shard }
param layers.0.router.bias [experts] replicate
""",
        "manifest": MANIFEST,
        "buffers": BUFFERS,  # layers.1.router.bias: no rule, whole on every rank
        "expect": [],
    },
    {
        "name": "a local shard the module holds",
        "spec": HEAD
        + RULES
        + "param layers.*.router.bias [experts] {\n"
        + "    local tp  shard experts over tp  replicate dp_shard\n}\n",
        "manifest": MANIFEST,
        "buffers": BUFFERS,
        "expect": [],
    },
]

# With a pipeline block, rules match buffers as they do without one (a buffer lives on its
# module's stage): the same check.
PP_HEAD = 'manifest "m.json"\nmesh over 8 ranks { pp: 2  dp_shard: * }\nfsdp dp_shard\n'
PP_MANIFEST = {"layers.0.w.weight": [8, 8], "layers.1.w.weight": [8, 8]}
PP_BUFFERS = {"layers.0.router.bias": [4], "layers.1.router.bias": [4]}
PIPELINE = "pipeline pp { split layers.{layer} }\n"
CASES += [
    {
        "name": "a pipeline stage's buffer sharded by the fsdp default",
        "spec": PP_HEAD + "param layers.*.w.weight [out, in] {}\n"
        "param layers.*.router.bias [experts] {}\n" + PIPELINE,
        "manifest": PP_MANIFEST,
        "buffers": PP_BUFFERS,
        "expect": [
            (
                "SS087",
                5,
                "buffer 'layers.0.router.bias' (and 1 more) is sharded over dp_shard (the fsdp "
                "default)",
                "layers.*.router.bias",
            )
        ],
    },
    {
        "name": "a pipeline stage's buffer replicated",
        "spec": PP_HEAD + "param layers.*.w.weight [out, in] {}\n"
        "param layers.*.router.bias [experts] replicate\n" + PIPELINE,
        "manifest": PP_MANIFEST,
        "buffers": PP_BUFFERS,
        "expect": [],
    },
]
