"""SS128 transfer-no-hf-block: a spec of the pair has no hf block to join through."""

from tests.checks.transfer_pair import SPEC, pair

CASES = [
    {
        "name": "an engine spec without an hf block",
        **pair(engine_spec=SPEC.split("hf {")[0]),
        "expect": [("SS128", "engine.shard:1", "the engine spec", "", "add `manifest")],
    },
    {
        "name": "both specs with hf blocks",
        **pair(),
        "expect": [],
    },
]
