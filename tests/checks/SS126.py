"""SS126 transfer-dtype-mismatch: a dtype the sender cannot cast into the engine's."""

from tests.checks.transfer_pair import pair

CASES = [
    {
        "name": "float weights into an int8 engine",
        **pair(engine_fields={"w.weight": {"dtype": "int8"}}),
        "expect": [
            ("SS126", "engine.shard:8", "w.proj is float32 on the trainer and int8", "w.proj")
        ],
    },
    {
        "name": "fp32 master weights into a bf16 engine",
        **pair(engine_fields={"w.weight": {"dtype": "bfloat16"}}),
        "expect": [],
    },
]
