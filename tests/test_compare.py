"""The comparison engine, in this process, on the current backend."""

import keras
import pytest

from keras_mha import compare

SEED_CASE = compare.get_cases(["seq6_scores"])[0]


def test_seed_case_matches_builtin_outputs_scores_and_gradients():
    record = compare.compare_case(SEED_CASE, quick=True, repeats=1)
    assert record["backend"] == keras.backend.backend()
    assert record["case"] == "seq6_scores"
    assert record["query_shape"] == [10, 6, 8]
    assert record["builtin_error"] is None and record["ours_error"] is None
    assert record["max_abs_diff"] <= 1e-4
    assert record["scores_max_abs_diff"] <= 1e-4
    assert record["grad_max_abs_diff"] <= 1e-4 * max(1.0, record["grad_scale"])
    assert record["grad_scale"] > 0
    assert record["passed"] is True
    for key in ("ours_predict_ms", "builtin_predict_ms", "ours_train_ms", "builtin_train_ms"):
        assert record[key] > 0
    assert record["predict_ratio"] == pytest.approx(
        record["ours_predict_ms"] / record["builtin_predict_ms"]
    )
    assert set(compare.RECORD_KEYS) <= set(record)


def test_timed_rounds_keep_their_quartiles():
    record = compare.compare_case(SEED_CASE, quick=True, repeats=4)
    for step in ("predict", "train"):
        for side in ("ours", "builtin"):
            low, high = record[f"{side}_{step}_quartiles"]
            assert 0 < low <= record[f"{side}_{step}_ms"] <= high
        low, high = record[f"{step}_ratio_quartiles"]
        assert 0 < low <= high


def test_perturbed_weights_are_caught_on_outputs_scores_and_gradients():
    record = compare.compare_case(SEED_CASE, quick=True, repeats=0, perturb=1e-2)
    assert record["max_abs_diff"] > 1e-4
    assert record["scores_max_abs_diff"] > 1e-4
    assert record["grad_max_abs_diff"] > 1e-4 * max(1.0, record["grad_scale"])
    assert record["passed"] is False
    assert record["ours_predict_ms"] is None  # repeats=0 skips timing


def test_cross_attention_compares_gradients_of_both_inputs():
    case = compare.Case(
        "tiny_cross",
        (2, 3, 8),
        value_shape=(2, 5, 4),
        layer_kwargs={"num_heads": 2, "key_dim": 4},
        call_kwargs={"use_causal_mask": True},
    )
    record = compare.compare_case(case, repeats=0)
    assert record["value_shape"] == [2, 5, 4]
    assert record["passed"] is True
    assert record["max_abs_diff"] <= 1e-4


def test_builtin_failure_is_recorded_not_raised():
    # The built-in has no `implementation`: it fails on every backend, ours runs.
    case = compare.Case(
        "chunked",
        (2, 6, 8),
        layer_kwargs={"num_heads": 2, "key_dim": 4, "implementation": "chunked"},
    )
    record = compare.compare_case(case, repeats=1)
    assert "implementation" in record["builtin_error"]
    assert record["ours_error"] is None
    assert record["max_abs_diff"] is None and record["builtin_predict_ms"] is None
    assert record["ours_predict_ms"] > 0 and record["ours_train_ms"] > 0
    assert record["predict_ratio"] is None
    assert record["passed"] is True


def test_our_failure_is_a_failed_record():
    case = compare.Case("bad", (2, 6, 8), layer_kwargs={"num_heads": 0, "key_dim": 4})
    record = compare.compare_case(case, repeats=1)
    assert "num_heads" in record["ours_error"]
    assert record["passed"] is False


@pytest.mark.parametrize(
    "diffs, expected",
    [
        ({"max_abs_diff": 5e-5}, True),
        ({"max_abs_diff": 2e-4}, False),
        ({"scores_max_abs_diff": 2e-4}, False),
        ({"grad_max_abs_diff": 5e-4, "grad_scale": 10.0}, True),  # relative beyond 1
        ({"grad_max_abs_diff": 2e-3, "grad_scale": 10.0}, False),
        ({"grad_max_abs_diff": 2e-4, "grad_scale": 0.5}, False),  # absolute below 1
        ({}, True),  # nothing measured (the built-in failed)
    ],
)
def test_within_tolerance(diffs, expected):
    assert compare.within_tolerance({"tolerance": 1e-4, **diffs}) is expected


def test_default_cases_include_the_seed_examples():
    cases = {case.name: case for case in compare.DEFAULT_CASES}
    assert cases["h8_k64"].query_shape == (32, 128, 512)
    assert cases["h4_k128"].layer_kwargs == {"num_heads": 4, "key_dim": 128}
    assert cases["h8_k64_v32"].layer_kwargs["value_dim"] == 32
    assert cases["seq6_scores"].wants_scores
    assert cases["causal"].call_kwargs["use_causal_mask"]
    query, value = cases["cross"].shapes()
    assert query[1] != value[1]
    assert cases["long_seq"].query_shape[1] >= 1024
    for case in compare.DEFAULT_CASES:
        quick_query, _ = case.shapes(quick=True)
        assert quick_query[0] * quick_query[1] <= case.query_shape[0] * case.query_shape[1]


def test_case_round_trips_through_a_dict():
    case = compare.DEFAULT_CASES[5]
    assert compare.Case.from_dict(case.to_dict()) == case


def test_unknown_case_name_is_a_clear_error():
    with pytest.raises(ValueError, match=r"argument `cases`.*Received: cases=\['nope'\]"):
        compare.get_cases(["nope"])


def test_summary_counts_per_backend():
    records = [
        {"backend": "jax", "passed": True, "builtin_error": "x"},
        {"backend": "jax", "passed": False, "builtin_error": None},
        {"backend": "torch", "passed": True, "builtin_error": None},
    ]
    result = compare.summary(records)
    assert result["jax"] == {
        "cases": 2,
        "passed": 1,
        "failed": 1,
        "builtin_failed": 1,
        "passed_all": False,
    }
    assert result["torch"]["passed_all"] is True
