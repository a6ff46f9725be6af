"""Step 2: the ranking losses against direct computations, and a real (tiny) training run."""

import itertools
import math

import pytest
import torch

from dschat_lib import data, models, reward, runtime, tokenizer
from dschat_lib.engine import TrainSettings


def test_pairwise_loss_is_negative_log_sigmoid_of_the_margin():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([1.0, 0.0, 3.0])
    expected = sum(-math.log(1 / (1 + math.exp(-(c - r)))) for c, r in zip(chosen.tolist(), rejected.tolist())) / 3
    assert reward.pairwise_loss(chosen, rejected).item() == pytest.approx(expected, rel=1e-6)
    # Only differences matter: shifting every score changes nothing.
    assert reward.pairwise_loss(chosen + 7, rejected + 7).item() == pytest.approx(expected, rel=1e-6)


def test_pairwise_loss_stays_finite_for_huge_margins():
    loss = reward.pairwise_loss(torch.tensor([-200.0]), torch.tensor([200.0]))
    assert torch.isfinite(loss) and loss.item() == pytest.approx(400.0)


def test_k_wise_loss_is_the_mean_over_all_ordered_pairs():
    scores = torch.tensor([[3.0, 1.0, 2.0, -1.0], [0.5, 0.4, 0.3, 0.2]])
    per_prompt = []
    for row in scores.tolist():
        pairs = list(itertools.combinations(range(4), 2))
        per_prompt.append(sum(math.log1p(math.exp(-(row[i] - row[j]))) for i, j in pairs) / len(pairs))
    assert reward.k_wise_loss(scores).item() == pytest.approx(sum(per_prompt) / 2, rel=1e-6)


def test_k_wise_with_two_responses_is_the_pairwise_loss():
    chosen, rejected = torch.randn(5), torch.randn(5)
    assert reward.k_wise_loss(torch.stack([chosen, rejected], 1)).item() == pytest.approx(
        reward.pairwise_loss(chosen, rejected).item(), rel=1e-6)


def test_k_wise_needs_two_responses():
    with pytest.raises(ValueError):
        reward.k_wise_loss(torch.zeros(3, 1))


def test_spearman_known_values():
    assert reward.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert reward.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert reward.spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)


@pytest.fixture(scope="module")
def tok():
    return tokenizer.load_tokenizer()


def _tiny_reward_model(tok, seed=0):
    return models.create_reward_model("cpu-tiny", tok, seed=seed, num_hidden_layers=1)


def test_training_separates_chosen_from_rejected(tok):
    """A real DeepSpeed run on 32 pairs: accuracy on those pairs must rise to near 1."""
    runtime.seed_everything(0)
    runtime.init_distributed()
    rows = data.load_shipped("train")[:32]
    items, _ = data.tokenize_phase(rows, tok, 2, max_seq_len=64)
    collate = data.PairCollator(tok.pad_token_id)
    batches = [collate(items[i:i + 16]) for i in range(0, 32, 16)]
    model = _tiny_reward_model(tok)
    settings = TrainSettings(per_device_train_batch_size=16, learning_rate=3e-3, dtype="fp32",
                             lr_scheduler_type="constant")
    engine, report = reward.train_reward_model(model, batches * 20, batches, settings, progress=False)
    try:
        assert report.after["acc"] >= 0.9 > report.before["acc"] - 0.2
        assert report.after["margin"] > report.before["margin"] + 1.0
        assert report.history[-1]["loss"] < report.history[0]["loss"]
        table = report.table()
        assert [row["when"] for row in table] == ["before", "after"]
        # rw_eval scores the same sequences the same way as the batched evaluation does.
        scores = reward.score_responses(engine.module, tok, [r["prompt"] for r in rows[:4]],
                                        [r["chosen"] for r in rows[:4]])
        assert scores == pytest.approx(report.after["chosen"][:4], abs=1e-4)
    finally:
        runtime.teardown(engine)


def test_k_wise_training_runs_and_ranks(tok):
    runtime.seed_everything(0)
    runtime.init_distributed()
    rows = data.load_shipped("k_wise_train")[:16]
    items, _ = data.tokenize_k_wise(rows, tok, max_seq_len=64)
    batches = [data.KWiseCollator(tok.pad_token_id)(items[i:i + 8]) for i in (0, 8)]
    pair_rows = [{"prompt": r["prompt"], "chosen": r["responses"][0], "rejected": r["responses"][-1]}
                 for r in rows]
    pair_items, _ = data.tokenize_phase(pair_rows, tok, 2, max_seq_len=64)
    eval_batches = [data.PairCollator(tok.pad_token_id)(pair_items)]
    settings = TrainSettings(per_device_train_batch_size=32, learning_rate=3e-3, dtype="fp32",
                             lr_scheduler_type="constant")
    engine, report = reward.train_reward_model(_tiny_reward_model(tok), batches * 15, eval_batches,
                                               settings, loss="k_wise", progress=False)
    try:
        assert report.after["acc"] >= 0.9
        agreement = reward.ranking_agreement(engine.module, tok, rows)
        assert agreement["pair_agreement"] > 0.8 and agreement["spearman"] > 0.5
    finally:
        runtime.teardown(engine)
