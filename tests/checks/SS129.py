"""SS129 transfer-unread-tensor: the trainer produces an HF tensor the engine does not read."""

from tests.checks.transfer_pair import SPEC, pair

NO_NORM = SPEC.replace("    n.proj -> n.weight\n", "")

CASES = [
    {
        "name": "the engine has no line for the norm",
        **pair(
            engine_spec=NO_NORM.replace("param n.weight [cols] {}\n", ""),
            engine_manifest={"w.weight": (8, 4)},
        ),
        "expect": [("SS129", 9, "the trainer produces n.proj", "n.proj", "drop n.proj")],
    },
    {
        "name": "the engine drops it",
        **pair(
            engine_spec=NO_NORM.replace("param n.weight [cols] {}\n", "").replace(
                "hf {", "hf {\n    drop n.proj"
            ),
            engine_manifest={"w.weight": (8, 4)},
        ),
        "expect": [],
    },
]
