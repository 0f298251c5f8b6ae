"""benchmarks/testing/fingerprint.py's comparison: equal weights and every figure logged before equal after; a figure added
is listed, a figure changed, missing or renamed without --renamed is a difference."""

from benchmarks.testing.fingerprint import compare


def test_compare_allows_added_figures_and_declared_renames_only():
    def fp(records, weights="ab"):
        return {"m": {"command": "python m.py", "weights_sha256": weights, "records": records}}

    before = fp([{"iteration": 1, "losses/old": 0.0, "eval/reward": 0.5}])
    assert compare(before, fp([{"iteration": 1, "losses/old": 0.0, "eval/reward": 0.5, "losses/new": 1.0}]))
    renamed = fp([{"iteration": 1, "losses/first": 0.0, "eval/reward": 0.5}])
    assert not compare(before, renamed)
    assert compare(before, renamed, {"losses/old": "losses/first"})
    assert not compare(before, fp([{"iteration": 1, "losses/old": 0.0, "eval/reward": 0.5000001}]))
    assert not compare(before, fp(before["m"]["records"], weights="ac"))
    assert not compare(before, {})
