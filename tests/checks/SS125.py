"""SS125 transfer-shape-mismatch: one HF tensor, two shapes."""

from tests.checks.transfer_pair import SPEC, pair

CASES = [
    {
        "name": "another hidden size on the engine",
        **pair(engine_manifest={"w.weight": (8, 6), "n.weight": (4,)}),
        "expect": [("SS125", "engine.shard:8", "w.proj is [8, 4] on the trainer", "w.proj")],
    },
    {
        "name": "the same shapes on another mesh",
        **pair(
            engine_spec=SPEC.replace("mesh over 2 ranks { tp: 2 }", "mesh over 1 ranks { tp: 1 }")
        ),
        "expect": [],
    },
]
