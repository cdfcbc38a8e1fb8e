"""SS041 unused-rule: a rule or ignore that matches nothing. The hint tells a name that
exists only in state_dict() (a state-dict hook's key, a buffer of a pipeline stage) from a
typo. A rule for a buffer outside pipeline stages places it (see SS087)."""

import json

# A torchtitan-like attention (examples/models/llama3_fused.py): the parameter is the fused
# qkv_linear.wqkv; state-dict hooks show it as wq/wk/wv. As `shardspec manifest` writes it.
_WQKV = "layers.{i}.attention.qkv_linear.wqkv.weight"


def _hooked_manifest() -> str:
    entries, keys = [], []
    for i in range(2):
        wqkv = _WQKV.format(i=i)
        entries.append({"fqn": wqkv, "kind": "param", "shape": [128, 64], "dtype": "float32"})
        entries.append(
            {"fqn": f"layers.{i}.attention.wo.weight", "shape": [64, 64], "dtype": "float32"}
        )
        keys.append({"fqn": wqkv, "change": "dropped", "module": f"layers.{i}.attention"})
        for name, rows in (("wq", 64), ("wk", 32), ("wv", 32)):
            keys.append(
                {
                    "fqn": f"layers.{i}.attention.{name}.weight",
                    "change": "added",
                    "module": f"layers.{i}.attention",
                    "from": [wqkv],
                    "shape": [rows, 64],
                    "dtype": "float32",
                }
            )
    entries.append({"fqn": "rope.cache", "kind": "buffer", "shape": [16, 8], "dtype": "float32"})
    hooks = {f"layers.{i}.attention": ["state_dict hook"] for i in range(2)}
    doc = {"format": "shardspec-manifest/2", "entries": entries}
    doc["state_dict"] = {"hooks": hooks, "keys": keys}
    return json.dumps(doc, indent=1)


HOOKED = _hooked_manifest()
# The same model described by a format-1 manifest (built from state_dict()): the hooks'
# keys look like buffers, and wqkv is missing.
LEGACY = json.dumps(
    {
        "format": "shardspec-manifest/1",
        "entries": [
            {"fqn": "layers.0.attention.wo.weight", "shape": [64, 64]},
            {"fqn": "layers.0.attention.wq.weight", "kind": "buffer", "shape": [64, 64]},
        ],
    }
)

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
NO_BIAS = {"attn.wq.weight": [8, 8], "attn.wo.weight": [8, 8]}

CASES = [
    {
        "name": "bias rule for a model built with bias=False",
        "spec": HEAD
        + """\
param **.weight [out, in] {}
param **.bias [out] replicate
""",
        "manifest": NO_BIAS,
        "expect": [("SS041", 5, "rule '**.bias' matches no parameter", "**.bias")],
    },
    {
        "name": "unused ignore",
        "spec": HEAD
        + """\
ignore **._extra_state
param **.weight [out, in] {}
""",
        "manifest": NO_BIAS,
        "expect": [("SS041", 4, "ignore '**._extra_state' matches nothing", "**._extra_state")],
    },
    {
        "name": "rule for ignored parameters only",
        "spec": HEAD
        + """\
ignore attn.wo.*
param attn.wo.weight [out, in] {}
param **.weight [out, in] {}
""",
        "manifest": NO_BIAS,
        "expect": [
            (
                "SS041",
                5,
                "rule 'attn.wo.weight' matches only ignored parameters (`ignore attn.wo.*`, "
                "line 4)",
                "attn.wo.weight",
            )
        ],
    },
    {
        "name": "every rule and ignore used",
        "spec": HEAD
        + """\
ignore attn.wo.*
param **.weight [out, in] {}
""",
        "manifest": NO_BIAS,
        "expect": [],
    },
    {
        "name": "a rule for a state-dict hook's key",
        "spec": HEAD
        + """\
param layers.*.attention.wq.weight [out, in] {}
param layers.*.attention.wo.weight [out, in] {}
ignore rope.*
""",
        "manifest_text": HOOKED,
        "expect": [
            (
                "SS040",
                "m.json:5",
                "parameter 'layers.0.attention.qkv_linear.wqkv.weight' [128, 64] is matched by "
                "no rule",
            ),
            (
                "SS040",
                "m.json:22",
                "parameter 'layers.1.attention.qkv_linear.wqkv.weight'",
            ),
            (
                "SS041",
                4,
                "rule 'layers.*.attention.wq.weight' matches no parameter",
                "layers.*.attention.wq.weight",
                "`layers.0.attention.wq.weight` (and 1 more such name) exists only in "
                "state_dict() (written by a state-dict hook of layers.0.attention, from the "
                "parameter layers.0.attention.qkv_linear.wqkv.weight); rules match parameters "
                "as the model holds them: write the rule for "
                "`layers.*.attention.qkv_linear.wqkv.weight`",
            ),
        ],
    },
    {
        "name": "rules for the parameter behind the hooks; an ignore for the hooks' keys",
        "spec": HEAD
        + """\
param layers.*.attention.qkv_linear.wqkv.weight [out, in] {}
param layers.*.attention.wo.weight [out, in] {}
ignore layers.*.attention.w{q,k,v}.weight
ignore rope.cache
""",
        "manifest_text": HOOKED,
        "expect": [],
    },
    {
        "name": "a rule for a buffer places it",
        "spec": HEAD
        + """\
param layers.*.attention.qkv_linear.wqkv.weight [out, in] {}
param layers.*.attention.wo.weight [out, in] {}
param rope.cache [a, b] replicate
ignore layers.*.attention.w{q,k,v}.weight
""",
        "manifest_text": HOOKED,
        "expect": [],
    },
    {
        "name": "a rule for a buffer of a pipeline stage: used, as without stages",
        "spec": """\
manifest "m.json"
mesh over 8 ranks { pp: 2  dp_shard: * }
fsdp dp_shard
param layers.*.weight [out, in] {}
param rope.cache [a, b] replicate
pipeline pp { split layers.{layer} }
""",
        "manifest": {"layers.0.weight": [8, 8], "layers.1.weight": [8, 8]},
        "buffers": {"rope.cache": [16, 8]},
        "expect": [],
    },
    {
        "name": "a format-1 manifest: the hook's key looks like a buffer",
        "spec": HEAD
        + """\
param layers.*.attention.w{q,o}.weight [out, in] {}
param layers.*.attention.wq.weight [out, in] {}
""",
        "manifest_text": LEGACY,
        "expect": [
            (
                "SS041",
                5,
                "rule 'layers.*.attention.wq.weight' matches no parameter",
                "layers.*.attention.wq.weight",
                "the manifest is of format 1, built from state_dict(), where a state-dict "
                "hook's key looks like a buffer: rebuild it with `shardspec manifest`",
            )
        ],
    },
    {
        "name": "a typo: the closest parameter names",
        "spec": HEAD
        + """\
param layers.*.attention.qkv_linear.wqvk.weight [out, in] {}
param **.weight [out, in] {}
""",
        "manifest_text": HOOKED,
        "expect": [
            (
                "SS041",
                4,
                "rule 'layers.*.attention.qkv_linear.wqvk.weight' matches no parameter",
                "layers.*.attention.qkv_linear.wqvk.weight",
                "did you mean `layers.*.attention.qkv_linear.wqkv.weight`? no parameter has "
                "a name like it",
            ),
        ],
    },
    {
        "name": "a rule with a broken sibling is still checked",
        "spec": HEAD
        + """\
param **.weight [out, in] { shard out over tpp }
param **.bias [out] replicate
""",
        "manifest": NO_BIAS,
        "expect": [
            ("SS011", 4, "unknown mesh axis 'tpp'"),
            ("SS041", 5, "rule '**.bias' matches no parameter"),
        ],
    },
]
