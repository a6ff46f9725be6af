def test_intro_training_reduces_loss(glue):
    values = glue("00-introduction")
    assert values["intro_final_loss"] < values["intro_initial_loss"]
    # Learning, not noise: well below a uniform guess over the vocabulary.
    assert values["intro_final_loss"] < 0.75 * values["intro_uniform_loss"]
    assert values["intro_tokens_per_s"] > 0
    assert "image/png" in values["intro_loss_plot"]
