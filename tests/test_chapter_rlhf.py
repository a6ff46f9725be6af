"""The claims the reward-model, PPO and end-to-end chapters make, asserted on the values their
notebooks recorded (see conftest.glue), plus a library-level check over several seeds."""

import pytest

#: The acceptance bar of the reward-model chapter.
RM_MIN_ACCURACY = 0.75
#: "Well above before": the trained model must beat the untrained one by at least this much.
RM_MIN_GAIN = 0.15


@pytest.mark.notebook
def test_reward_model_chapter(glue):
    values = glue("07-reward")
    assert values["rm_acc_after"] >= RM_MIN_ACCURACY
    assert values["rm_acc_after"] >= values["rm_acc_before"] + RM_MIN_GAIN
    assert values["rm_chosen_score_after"] > values["rm_rejected_score_after"]
    assert values["rm_margin_after"] > 0
    # The prose says the model orders ground-truth pairs better than a coin would.
    assert values["rm_pair_agreement"] > 0.5 and values["rm_spearman"] > 0
    # rw_eval, as the prose reads it: format and length errors cost a lot, a wrong order little.
    assert values["rw_commas_score"] < values["rw_correct_score"] - 1
    assert values["rw_missing_score"] < values["rw_correct_score"] - 1
    assert values["rw_wrong_order_score"] > values["rw_correct_score"] - 0.5
    # On the policy's own samples the reward model is much weaker than on the dataset's pairs.
    assert values["rm_policy_agreement"] < values["rm_pair_agreement"]
    for key in ("rm_training_plot", "rm_score_distributions", "rm_agreement_plot"):
        assert "image/png" in values[key]
    # "On ordering ground-truth pairs the two objectives end up close"; the pairwise model's
    # accuracy is the higher one (the style pairs are in its data only).
    assert RM_MIN_ACCURACY <= values["rm_kwise_acc_after"] <= values["rm_acc_after"]
    assert abs(values["rm_kwise_pair_agreement"] - values["rm_pair_agreement"]) < 0.1


#: PPO's margins, asserted for every seed the PPO notebook runs (3 by default). Measured with
#: the default parameters: reward gains of about 0.7-1.2, ground-truth gains of +0.02 to +0.07,
#: final KL under 1.1 nats.
PPO_MIN_REWARD_GAIN = 0.3
PPO_MIN_TRUTH_GAIN = 0.01
PPO_MAX_KL = 3.0
#: The share of bare-list answers must rise by at least this much (the style PPO learns).
PPO_MIN_FORMAT_GAIN = 0.1


@pytest.mark.notebook
def test_ppo_chapter(glue):
    values = glue("08-ppo")
    assert values["ppo_seeds"] == 3
    # PPO raises the reward model's score of sampled responses, for every seed ...
    assert values["ppo_reward_rlhf"] > values["ppo_reward_sft"] + PPO_MIN_REWARD_GAIN
    assert min(values["ppo_seed_reward_gains"]) > PPO_MIN_REWARD_GAIN
    # ... and the ground-truth score, which PPO never sees, for every seed ...
    assert values["ppo_truth_rlhf"] > values["ppo_truth_sft"] + PPO_MIN_TRUTH_GAIN
    assert values["ppo_seed_truth_changes"][0] == pytest.approx(values["ppo_truth_rlhf"] - values["ppo_truth_sft"], abs=1e-3)
    assert values["ppo_seed_truth_change_min"] > PPO_MIN_TRUTH_GAIN
    # ... with a KL to the reference that stays bounded (nats per response).
    assert 0 < values["ppo_kl_final"] < PPO_MAX_KL
    assert all(0 < kl < PPO_MAX_KL for kl in values["ppo_seed_kls"])
    # The prose: most of the gain is the answer format the style pairs taught the reward model.
    assert values["ppo_well_formed_rlhf"] > values["ppo_well_formed_sft"] + PPO_MIN_FORMAT_GAIN
    assert values["ppo_seed_well_formed_rlhf_min"] > values["ppo_well_formed_sft"]
    # The prose: small, careful steps (clip active on a few per cent of tokens), a critic that learns.
    assert values["ppo_approx_kl_max"] < 0.2 and 0 < values["ppo_clipfrac_mean"] < 0.1
    assert values["ppo_explained_var_last"] > values["ppo_explained_var_first"]
    assert "image/png" in values["ppo_history_plot"]


@pytest.mark.notebook
def test_end_to_end_chapter(glue):
    values = glue("09-end-to-end")
    # Step 1 is what teaches the task: SFT beats the random base on truth and perplexity.
    assert values["e2e_truth_sft"] > values["e2e_truth_base"] + 0.2
    assert values["e2e_perplexity_sft"] < values["e2e_perplexity_base"] / 2
    assert values["e2e_kl_sft"] == pytest.approx(0.0, abs=1e-6)
    assert values["e2e_kl_rlhf"] > 0
    # RLHF (PPO-ptx) improves on SFT in reward and truth; without ptx the reward rises further
    # while the ground truth falls below the ptx run's — the content skill erodes.
    assert values["e2e_reward_rlhf"] > values["e2e_reward_sft"]
    assert values["e2e_truth_rlhf"] > values["e2e_truth_sft"]
    assert values["e2e_well_formed_rlhf"] > values["e2e_well_formed_sft"]
    assert values["e2e_reward_noptx"] > values["e2e_reward_sft"]
    assert values["e2e_truth_noptx"] < values["e2e_truth_sft"] < values["e2e_truth_rlhf"]
    assert values["e2e_well_formed_noptx"] > values["e2e_well_formed_sft"]
    assert values["e2e_perplexity_noptx"] > 1.5 * values["e2e_perplexity_sft"]
    # Reward hacking, as the prose describes it: the weak reward model's score rises while the
    # ground truth does not.
    assert values["hack_reward_rlhf"] > values["hack_reward_sft"]
    assert values["hack_truth_rlhf"] <= values["hack_truth_sft"]
    assert "image/png" in values["hack_history_plot"]

