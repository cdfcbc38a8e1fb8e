"""SS124 transfer-missing-source: the engine reads an HF tensor the trainer does not produce."""

from tests.checks.transfer_pair import SPEC, pair

CASES = [
    {
        "name": "a typo in the engine's HF name",
        **pair(engine_spec=SPEC.replace("n.proj ->", "n.prj ->")),
        "expect": [
            ("SS124", "engine.shard:9", "the engine reads n.prj", "n.prj", "did you mean n.proj"),
            ("SS129", "spec.shard:9", "the trainer produces n.proj", "n.proj"),
        ],
    },
    {
        "name": "a tie on the trainer side gives the source",
        **pair(
            engine_spec=SPEC.replace("n.proj ->", "n.alias ->"),
            spec=SPEC.replace(
                "    n.proj -> n.weight", "    n.proj -> n.weight\n    tie n.alias = n.proj"
            ),
        ),
        "expect": [],
    },
]
