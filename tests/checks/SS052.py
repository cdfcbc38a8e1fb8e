"""SS052 bad-fusion: a malformed `fuse` statement."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
MANIFEST = {"w13": [16, 8]}


def rule(*items: str) -> str:
    return HEAD + "param w13 [ffn, hidden] {\n" + "".join(f"    {i}\n" for i in items) + "}\n"


CASES = [
    {
        "name": "size for some components only",
        "spec": rule("fuse ffn as gate 8, up", "shard hidden over dp_shard"),
        "manifest": MANIFEST,
        "expect": [("SS052", 5, "component 'up' has no size while others have one", "up")],
    },
    {
        "name": "component named twice",
        "spec": rule("fuse ffn as gate, gate", "shard hidden over dp_shard"),
        "manifest": MANIFEST,
        "expect": [("SS052", 5, "component 'gate' is named twice", "gate,")],
    },
    {
        "name": "dimension fused twice",
        "spec": rule("fuse ffn as gate, up", "fuse ffn as a, b", "shard hidden over dp_shard"),
        "manifest": MANIFEST,
        "expect": [("SS052", 6, "dimension 'ffn' is fused twice", "fuse ffn as a")],
    },
    {
        "name": "two fused dimensions",
        "spec": rule("fuse ffn as gate, up", "fuse hidden as a, b", "shard hidden over dp_shard"),
        "manifest": MANIFEST,
        "expect": [("SS052", 6, "dimensions 'ffn' and 'hidden' are both fused", "fuse hidden")],
    },
    {
        "name": "one component",
        "spec": rule("fuse ffn as gate", "shard hidden over dp_shard"),
        "manifest": MANIFEST,
        "expect": [("SS052", 5, "a fusion needs at least two components", "fuse")],
    },
    {
        "name": "zero groups",
        "spec": rule("fuse ffn as 0 groups of gate, up", "shard hidden over dp_shard"),
        "manifest": MANIFEST,
        "expect": [("SS052", 5, "the group count must be at least 1", "fuse")],
    },
    {
        "name": "sizes for every component",
        "spec": rule("fuse ffn as gate 8, up 8", "shard hidden over dp_shard"),
        "manifest": MANIFEST,
        "expect": [],
    },
    {
        "name": "one group of one component",
        "spec": rule("fuse ffn as 1 groups of gate", "shard hidden over dp_shard"),
        "manifest": MANIFEST,
        "expect": [],
    },
]
