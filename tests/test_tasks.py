"""The shipped list task: the scorer gives exact partial credit, and the shipped files are what
the generator produces, with every chosen response scoring above its rejected one."""

import random

import pytest

from dschat_lib import data, tasks

SORT = "\n\nHuman: Sort these numbers in ascending order: 7 2 9 4\n\nAssistant:"


def test_exact_answer_scores_one_and_nothing_scores_zero():
    assert tasks.score(SORT, " 2 4 7 9") == 1.0
    assert tasks.score(SORT, "") == 0.0
    assert tasks.score(SORT, " the the the") == 0.0


def test_partial_credit_is_graded():
    one_dropped = tasks.score(SORT, " 2 4 9")
    two_dropped = tasks.score(SORT, " 2 9")
    swapped = tasks.score(SORT, " 2 7 4 9")
    assert 1.0 > one_dropped > two_dropped > 0.0
    # edit distance of a swap is 2 substitutions out of 4 items: similarity 0.5
    assert swapped == pytest.approx(tasks.FORMAT_WEIGHT + (1 - tasks.FORMAT_WEIGHT) * 0.5)


def test_format_matters_on_top_of_content():
    assert tasks.score(SORT, " 2, 4, 7, 9") == pytest.approx(1 - tasks.FORMAT_WEIGHT)
    assert tasks.score(SORT, " Sure! The answer is 2 4 7 9.") == pytest.approx(1 - tasks.FORMAT_WEIGHT)
    parts = tasks.score_components(SORT, " 2 4 7 9")
    assert parts == {"well_formed": 1.0, "similarity": 1.0, "score": 1.0}


@pytest.mark.parametrize("operation, items, answer", [
    ("sort_ascending", (5, 1, 3), [1, 3, 5]),
    ("sort_descending", (5, 1, 3), [5, 3, 1]),
    ("reverse", (5, 1, 3), [3, 1, 5]),
    ("evens", (4, 7, 10, 3), [4, 10]),
    ("odds", (4, 7, 10, 3), [7, 3]),
    ("copy", (5, 1, 3), [5, 1, 3]),
])
def test_operations_and_prompt_round_trip(operation, items, answer):
    problem = tasks.Problem(operation, items)
    assert problem.answer == answer
    assert tasks.parse_prompt(problem.prompt) == problem
    assert tasks.score(problem.prompt, tasks.format_answer(answer)) == 1.0


@pytest.mark.parametrize("prompt", ["hello", "\n\nHuman: Sort these numbers in ascending order:\n\nAssistant:",
                                    SORT.replace("Assistant:", "Bot:")])
def test_a_foreign_prompt_is_an_error(prompt):
    with pytest.raises(tasks.TaskError, match="not a prompt of the list task"):
        tasks.score(prompt, " 1 2")


def test_edit_distance():
    assert tasks.edit_distance([1, 2, 3], [1, 2, 3]) == 0
    assert tasks.edit_distance([1, 2, 3], [1, 3]) == 1
    assert tasks.edit_distance([], [1, 2]) == 2
    assert tasks.edit_distance([1, 2], [2, 1]) == 2


def test_scores_stay_in_unit_interval_for_any_corruption():
    rng = random.Random(0)
    for _ in range(500):
        problem = tasks.random_problem(rng)
        response = tasks.corrupt(rng, problem, problem.answer, severity=rng.randint(0, 4))
        assert 0.0 <= tasks.score(problem.prompt, response) <= 1.0


def test_generated_rows_prefer_chosen_even_when_chosen_is_flawed():
    splits = tasks.generate_splits(seed=7, train_rows=400, eval_rows=50, k_wise_train_rows=50,
                                   k_wise_eval_rows=10)
    scores = [(tasks.score(r["prompt"], r["chosen"]), tasks.score(r["prompt"], r["rejected"]))
              for r in splits["train"]]
    assert all(c > r for c, r in scores)
    # Not every chosen response is perfect: the reward model must learn degrees of quality.
    assert 0 < sum(c < 1.0 for c, _ in scores) < len(scores) / 2


def test_style_never_marks_the_chosen_side():
    """Chatty demonstrations are paired with a chatty worse answer, and the style pairs put the
    bare list on the chosen side: "unformatted" predicts rejected, never chosen."""
    rows = tasks.generate_splits(seed=3, train_rows=2000, eval_rows=10, k_wise_train_rows=10,
                                 k_wise_eval_rows=10)["train"]
    formatted = lambda r, side: tasks.score_components(r["prompt"], r[side])["well_formed"] == 1.0
    chatty_chosen = [r for r in rows if not formatted(r, "chosen")]
    assert chatty_chosen and all(not formatted(r, "rejected") for r in chatty_chosen)
    stats = tasks.preference_stats(rows)
    assert stats["chosen_restyled_fraction"] == pytest.approx(tasks.CHATTY_CHOSEN_FRACTION, abs=0.04)
    assert stats["style_pair_fraction"] == pytest.approx(tasks.STYLE_PAIR_FRACTION, abs=0.04)
    style_pairs = [r for r in rows if tasks.score(r["prompt"], r["chosen"]) == 1.0
                   and tasks.score_components(r["prompt"], r["rejected"])["similarity"] == 1.0]
    assert all(formatted(r, "chosen") and not formatted(r, "rejected") for r in style_pairs)


def test_well_formed_fraction():
    assert tasks.well_formed_fraction([" 1 2 3", " Sure! The answer is 1 2 3.", " 1, 2"]) == pytest.approx(1 / 3)
    assert tasks.well_formed_fraction([]) == 0.0


# --------------------------------------------------------------------------- the shipped files

@pytest.fixture(scope="module")
def shipped():
    return {split: data.load_shipped(split) for split in data.SHIPPED_FILES}


def test_shipped_sizes(shipped):
    assert len(shipped["train"]) >= 10_000 and len(shipped["eval"]) >= 1_000
    assert len(shipped["k_wise_train"]) >= 1_000
    assert all(set(r) == {"prompt", "response", "chosen", "rejected"} for r in shipped["train"])
    assert all(r["response"] == r["chosen"] for r in shipped["train"])


def test_shipped_chosen_always_beats_rejected(shipped):
    for split in ("train", "eval"):
        for row in shipped[split]:
            assert tasks.score(row["prompt"], row["chosen"]) > tasks.score(row["prompt"], row["rejected"])


def test_shipped_k_wise_rows_are_ranked(shipped):
    for row in shipped["k_wise_train"] + shipped["k_wise_eval"]:
        assert len(row["responses"]) == tasks.K_WISE_K
        scores = [tasks.score(row["prompt"], r) for r in row["responses"]]
        assert scores == pytest.approx(row["scores"], abs=1e-6)
        assert all(a > b for a, b in zip(scores, scores[1:]))


def test_no_prompt_is_shared_between_splits(shipped):
    seen = set()
    for rows in shipped.values():
        prompts = {r["prompt"] for r in rows}
        assert len(prompts) == len(rows)
        assert not prompts & seen
        seen |= prompts


def test_regeneration_reproduces_the_shipped_files_exactly(tmp_path):
    written = data.regenerate(tmp_path)
    assert written
    for path in written:
        shipped_file = data.DATA_DIR / path.relative_to(tmp_path)
        assert shipped_file.read_bytes() == path.read_bytes(), f"{shipped_file} differs from a regeneration"
    shipped_files = {p.relative_to(data.DATA_DIR) for p in data.DATA_DIR.rglob("*")
                     if p.is_file() and p.name != "README.md"}
    assert shipped_files == {p.relative_to(tmp_path) for p in written}
