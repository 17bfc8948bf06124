"""Combining metric rows of micro-batches, ranks and steps (hf_core.engines.metric_rows)."""

from __future__ import annotations

from hf_core.engines import combine_metric_rows, rank_zero_row, worst_rank


def test_combine_metric_rows_means_maxima_and_sums() -> None:
    rows = [{"a": 1.0, "x_max": 3.0, "n_sum": 2.0, "loss": 1.0}, {"a": 3.0, "x_max": 5.0}]
    combined = combine_metric_rows([*rows, {"n_sum": 4.0, "loss": 2.0}], sums=("loss",))
    assert combined == {"a": 2.0, "x_max": 5.0, "n_sum": 6.0, "loss": 3.0}


def test_worst_rank_takes_maxima_and_minima_of_the_lowest_keys() -> None:
    rows = [
        {"bytes": 10.0, "seconds": 2.0, "all_ok": 1.0},
        {"bytes": 30.0, "seconds": 1.0, "all_ok": 0.0, "only_here": 4},
    ]
    assert worst_rank(rows, lowest=("all_ok",)) == {
        "bytes": 30.0,
        "seconds": 2.0,
        "all_ok": 0.0,
        "only_here": 4.0,
    }
    assert worst_rank([]) == {}


def test_rank_zero_row_is_rank_zeros_as_floats() -> None:
    assert rank_zero_row([{"loss": 1, "lr": 0.5}, {"loss": 2, "lr": 0.5}]) == {
        "loss": 1.0,
        "lr": 0.5,
    }
