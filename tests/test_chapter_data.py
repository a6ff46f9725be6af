"""The data chapter's claims, read from what notebooks/04-data.ipynb recorded."""

import pytest

from dschat_lib import tasks


def test_data_chapter_claims(glue):
    values = glue("04-data")
    assert values["data_train_rows"] >= 10_000
    assert values["data_eval_rows"] >= 1_000
    # The prose says chosen beats rejected under the ground truth in every row.
    assert values["data_chosen_beats_rejected_fraction"] == 1.0
    assert values["data_mean_chosen_score"] > values["data_mean_rejected_score"]
    # ...and that some chosen responses are imperfect, so SFT on chosen cannot be perfect.
    assert 0.5 < values["data_chosen_perfect_fraction"] < 1.0
    # ...that about CHATTY_CHOSEN_FRACTION of them have the right numbers in a chatty style, and
    # about STYLE_PAIR_FRACTION of rows are pure style preferences.
    assert values["data_chosen_restyled_fraction"] == pytest.approx(tasks.CHATTY_CHOSEN_FRACTION, abs=0.02)
    assert values["data_style_pair_fraction"] == pytest.approx(tasks.STYLE_PAIR_FRACTION, abs=0.02)
    assert "image/png" in values["data_score_hist"]
    assert values["data_format_weight"] == tasks.FORMAT_WEIGHT
    # Partial credit: a dropped number and a comma format each cost part of the score.
    assert 0 < values["data_ladder_drop_score"] < 1 and 0 < values["data_ladder_commas_score"] < 1
    assert values["data_k_wise_k"] >= 4 and values["data_k_wise_train_rows"] >= 1_000
    # data_split shares every training row between the three steps, in the stated proportions.
    steps = [values[f"data_step{p}_train_rows"] for p in (1, 2, 3)]
    assert sum(steps) == values["data_train_rows"]
    weights = [float(w) for w in values["data_split"].split(",")]
    for rows, weight in zip(steps, weights):
        assert abs(rows - values["data_train_rows"] * weight / sum(weights)) <= 1
    assert values["data_dropped_rows"] == 0
    assert values["data_max_tokens"] <= 64
    assert values["data_cache_first_hit"] is False and values["data_cache_second_hit"] is True
