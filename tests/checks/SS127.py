"""SS127 transfer-unsupported-layout: modules indexed by name are not planned yet."""

from tests.checks.transfer_pair import pair

LOCAL = """
manifest "m.json"
mesh over 2 ranks { ep: 2 }
param e.{x}.weight [x, rows, cols] {
    local ep
    shard x over ep
}
hf {
    experts.{x}.proj -> e.{x}.weight
}
"""
STACKED = """
manifest "m.json"
mesh over 2 ranks { ep: 2 }
param e.weight [x, rows, cols] {
    shard x over ep
}
hf {
    experts.{x}.proj -> e.weight[x]
}
"""

CASES = [
    {
        "name": "experts as one module each, by name",
        **pair(
            spec=STACKED,
            engine_spec=LOCAL,
            engine_manifest={"e.0.weight": (8, 4), "e.1.weight": (8, 4)},
        ),
        "manifest": {"e.weight": (4, 8, 4)},
        "expect": [("SS127", "engine.shard:3", "e.0.weight: a dimension indexed", "param")],
    },
    {
        "name": "experts stacked in one parameter on both sides",
        **pair(spec=STACKED, engine_spec=STACKED, engine_manifest={"e.weight": (4, 8, 4)}),
        "manifest": {"e.weight": (4, 8, 4)},
        "expect": [],
    },
]
