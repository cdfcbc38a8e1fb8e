"""SS133 pad-uneven-split: a padded dimension that does not split evenly over the axes
that shard it (vLLM holds padded vocab / tp rows on every rank)."""

from tests.checks.pad_model import HF, manifest, spec

CASES = [
    {
        "name": "1000 rows padded to a multiple of 7: 1001, not even over tp 2",
        "spec": spec(" pad 0 to 7"),
        "manifest": manifest(1001),
        "hf_manifest": HF,
        "expect": [
            # One cause, one finding: SS133 names the pad line that makes the split even;
            # SS023 (uneven-shard) on the rule's `shard vocab over tp` would say less.
            (
                "SS133",
                8,
                "tok.weight: the padded dimension 0 (1001) does not split evenly over tp",
                "pad 0 to 7",
                "`pad 0 to 7 x tp`",
            ),
        ],
    },
    {
        "name": "padded to 7 x tp: even",
        "spec": spec(" pad 0 to 7 x tp"),
        "manifest": manifest(1008),
        "hf_manifest": HF,
        "expect": [],
    },
]
