"""``shardspec.findings.suggest``: the one "did you mean" helper of the parser's and the
checks' hints."""

from __future__ import annotations

from shardspec.findings.suggest import CUTOFF, closest, did_you_mean, likeness


def test_closest_is_the_most_alike_choice_above_the_cutoff() -> None:
    assert closest("shrad", ("shard", "fuse", "style")) == "shard"
    assert closest("tp", ["dp", "tp", "pp"]) == "tp"
    assert closest("zzz", ("shard", "fuse")) is None
    assert closest("x", ()) is None


def test_likeness_is_difflibs_ratio_in_order() -> None:
    assert likeness("wq", "wq") == 1.0
    assert likeness("abc", "xyz") == 0.0
    assert likeness("wqkv", "wkv") == 2 * 3 / 7
    assert likeness("wkv", "wqkv") >= CUTOFF
    # not symmetric in general: a names the first sequence, b the second
    assert (likeness("aaba", "baaa"), likeness("baaa", "aaba")) == (0.75, 0.5)


def test_did_you_mean_names_the_closest_and_lists_every_choice() -> None:
    assert did_you_mean("tpp", ["dp", "tp"]) == "did you mean 'tp'? declared: dp, tp"
    assert did_you_mean("zz", ["dp", "tp"]) == "declared: dp, tp"
    assert did_you_mean("zz", []) == "declared: (none)"
    assert did_you_mean("colwis", ["colwise", "rowwise"], listed_as="styles") == (
        "did you mean 'colwise'? styles: colwise, rowwise"
    )


def test_closest_few_offers_several_best_first() -> None:
    from shardspec.findings.suggest import closest_few

    names = ["layers.0.wq.weight", "layers.0.wk.weight", "layers.1.wq.weight", "norm.weight"]
    assert closest_few("layers.0.wq.weigth", names, n=2, cutoff=0.5) == [
        "layers.0.wq.weight",
        "layers.1.wq.weight",
    ]
    assert closest_few("zzz", names) == []
