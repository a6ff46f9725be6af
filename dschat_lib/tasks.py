"""The book's shipped task: short list instructions whose answers can be scored exactly.

Human preference data has no ground truth, so a chapter trained on it can only report what
its own reward model thinks. This task has one. Every prompt asks for one operation on a
short list of numbers ("Sort these numbers in ascending order: 7 42 3 19"), the correct
answer follows from the prompt, and :func:`score` gives any response a mark in [0, 1]:

    score = FORMAT_WEIGHT * well_formed + (1 - FORMAT_WEIGHT) * list_similarity

``well_formed`` is 1 when the response is exactly a space-separated list of numbers;
``list_similarity`` is one minus the edit distance (insertions, deletions, substitutions of
whole numbers) between the numbers in the response and the correct list, divided by the
longer length. A dropped number, an extra one or two swapped neighbours each cost a
fraction of the mark, so a half-right answer earns about half. That is what lets the SFT,
reward-model and PPO chapters measure *how much* a model learned, not just whether it did.

Preference rows follow the ``Dahoas/rm-static`` schema (``prompt``, ``response``,
``chosen``, ``rejected``). ``chosen`` is usually the correct answer, sometimes the correct
numbers in a chatty style (both sides of such a row are chatty) and sometimes a slightly flawed
answer; some rows are pure style preferences (the bare list against the same numbers restyled).
``rejected`` always scores strictly lower — the generator checks it with :func:`score` row by
row. K-wise rows hold ``K_WISE_K`` responses
ranked best first, with strictly decreasing scores.

Everything is generated from one seed by :func:`generate_splits`; ``data/`` holds the
generated files and :mod:`dschat_lib.data` reads them.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable

# --------------------------------------------------------------------------- task constants

#: The numbers that appear in lists: 0 .. MAX_NUMBER. Each is one token of the shipped tokenizer.
#: Difficulty is set by these two constants. Measured with the cpu-tiny model (0.9 M parameters,
#: bf16, lr 1e-3, batches of 32 rows, greedy decoding on 300 eval prompts): with numbers up to 99
#: in lists of up to 7 the model had not learned to copy numbers from the prompt after 24 000
#: rows (score 0.18); numbers up to 9 were learned almost at once; with numbers up to 29 in lists
#: of up to 6, 1000 steps (about a minute on 2 idle cores) took the score from 0.01 to 0.61 and
#: 0.70 for two model seeds — well short of 1, with room left for the reward model and PPO.
MAX_NUMBER = 29
#: Shortest and longest input list.
MIN_ITEMS, MAX_ITEMS = 3, 6
#: Share of the score given for the format alone (a bare space-separated number list).
FORMAT_WEIGHT = 0.2
#: Share of preference rows whose ``chosen`` is the exact answer; the rest get a flawed-but-better one.
CHOSEN_PERFECT_FRACTION = 0.8
#: Share of preference rows whose ``chosen`` is the correct list wrapped in chatter ("Sure! The
#: answer is 4 7 9."): right content in a style the task does not ask for, so it scores
#: 1 - FORMAT_WEIGHT. Step 1 imitates ``chosen``, so the SFT model answers this way about as
#: often; the style pairs below tell the reward model the bare list is better, and step 3 can
#: act on that. Human demonstrations vary in style the same way, and moving a model between
#: behaviours it already has is what RLHF does most readily.
CHATTY_CHOSEN_FRACTION = 0.3
#: Share of preference rows that compare the bare correct list (chosen) with the same list in
#: another style — chatter or commas (rejected): pure style preferences, no content difference.
STYLE_PAIR_FRACTION = 0.2
#: Responses per prompt in the K-wise variant (DeepSpeed-Chat's K-wise reward model fork uses k >= 4).
K_WISE_K = 4

#: Split sizes of the shipped files, and the seed they are generated from.
TRAIN_ROWS, EVAL_ROWS = 20_000, 2_000
K_WISE_TRAIN_ROWS, K_WISE_EVAL_ROWS = 4_000, 400
DEFAULT_SEED = 1234

#: The conversation markers of the Anthropic HH / Dahoas schema that DeepSpeed-Chat trains on.
HUMAN, ASSISTANT = "\n\nHuman: ", "\n\nAssistant:"


@dataclass(frozen=True)
class Operation:
    """One kind of instruction: how it is phrased and what the correct answer is."""
    name: str
    instruction: str
    answer: Callable[[list[int]], list[int]]
    #: Whether an input list is acceptable (e.g. "list the even numbers" needs at least one).
    accepts: Callable[[list[int]], bool] = lambda items: True


OPERATIONS: dict[str, Operation] = {op.name: op for op in (
    Operation("sort_ascending", "Sort these numbers in ascending order:", sorted),
    Operation("sort_descending", "Sort these numbers in descending order:",
              lambda xs: sorted(xs, reverse=True)),
    Operation("reverse", "Reverse this list:", lambda xs: xs[::-1]),
    Operation("evens", "List the even numbers in:", lambda xs: [x for x in xs if x % 2 == 0],
              accepts=lambda xs: any(x % 2 == 0 for x in xs)),
    Operation("odds", "List the odd numbers in:", lambda xs: [x for x in xs if x % 2 == 1],
              accepts=lambda xs: any(x % 2 == 1 for x in xs)),
    Operation("copy", "Repeat this list:", list),
)}


# --------------------------------------------------------------------------- prompts

@dataclass(frozen=True)
class Problem:
    operation: str
    items: tuple[int, ...]

    @property
    def answer(self) -> list[int]:
        return list(OPERATIONS[self.operation].answer(list(self.items)))

    @property
    def prompt(self) -> str:
        """The prompt in the Dahoas/rm-static form: ``"\\n\\nHuman: ...\\n\\nAssistant:"``."""
        numbers = " ".join(str(x) for x in self.items)
        return f"{HUMAN}{OPERATIONS[self.operation].instruction} {numbers}{ASSISTANT}"


class TaskError(ValueError):
    """A prompt that is not one of this task's prompts."""


_NUMBER_LIST = r"(\d+(?: \d+)*)"
_PROMPT_PATTERNS = {name: re.compile(re.escape(HUMAN + op.instruction) + " " + _NUMBER_LIST
                                     + re.escape(ASSISTANT) + r"$")
                    for name, op in OPERATIONS.items()}


def parse_prompt(prompt: str) -> Problem:
    """The :class:`Problem` a prompt states; :class:`TaskError` if it is not a task prompt."""
    for name, pattern in _PROMPT_PATTERNS.items():
        match = pattern.match(prompt)
        if match:
            return Problem(name, tuple(int(x) for x in match.group(1).split()))
    raise TaskError(f"not a prompt of the list task: {prompt[:80]!r}")


def format_answer(items: list[int]) -> str:
    """A response as the task expects it: a leading space, numbers separated by single spaces."""
    return "".join(f" {x}" for x in items)


# --------------------------------------------------------------------------- the scorer

_WELL_FORMED = re.compile(r"^ ?\d+(?: \d+)*\s*$")


def edit_distance(a: list, b: list) -> int:
    """Levenshtein distance between two sequences (each item is one symbol)."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        current = [i]
        for j, y in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def list_similarity(got: list[int], expected: list[int]) -> float:
    """1 - edit_distance / longer length: 1.0 for the exact list, 0.0 for nothing in common."""
    longest = max(len(got), len(expected))
    return 1.0 if longest == 0 else 1.0 - edit_distance(got, expected) / longest


def score_components(prompt: str, response: str) -> dict[str, float]:
    """The parts of :func:`score`: ``well_formed`` (0/1), ``similarity`` and the total ``score``."""
    expected = parse_prompt(prompt).answer
    got = [int(x) for x in re.findall(r"\d+", response)]
    well_formed = float(bool(_WELL_FORMED.match(response)))
    similarity = list_similarity(got, expected)
    return {"well_formed": well_formed, "similarity": similarity,
            "score": FORMAT_WEIGHT * well_formed + (1 - FORMAT_WEIGHT) * similarity}


def well_formed_fraction(responses: list[str]) -> float:
    """Share of ``responses`` in the task's format (a bare space-separated list of numbers)."""
    return sum(bool(_WELL_FORMED.match(r)) for r in responses) / max(1, len(responses))


def score(prompt: str, response: str) -> float:
    """The ground-truth mark of ``response`` to ``prompt``, in [0, 1] (1 = exactly right)."""
    return score_components(prompt, response)["score"]


# --------------------------------------------------------------------------- corruptions
# Plausible mistakes, each a function (rng, answer items, problem) -> response text. They are
# the kinds of errors a small model makes: losing or inventing an item, order slips, copying
# the input instead of transforming it, and breaking the format.

def _drop(rng, items, problem):
    if len(items) < 2:
        return None
    out = list(items)
    del out[rng.randrange(len(out))]
    return format_answer(out)


def _extra(rng, items, problem):
    out = list(items)
    out.insert(rng.randrange(len(out) + 1), rng.randint(0, MAX_NUMBER))
    return format_answer(out)


def _swap(rng, items, problem):
    if len(items) < 2:
        return None
    out = list(items)
    i = rng.randrange(len(out) - 1)
    out[i], out[i + 1] = out[i + 1], out[i]
    return format_answer(out)


def _replace(rng, items, problem):
    out = list(items)
    out[rng.randrange(len(out))] = rng.randint(0, MAX_NUMBER)
    return format_answer(out)


def _copy_input(rng, items, problem):
    return format_answer(list(problem.items))


def _truncate(rng, items, problem):
    if len(items) < 2:
        return None
    return format_answer(items[: rng.randint(1, len(items) - 1)])


def _commas(rng, items, problem):
    return " " + ", ".join(str(x) for x in items)


def _chatter(rng, items, problem):
    lead = rng.choice(("Sure! The answer is", "Here you go:", "I think it is", "Okay,"))
    return f" {lead}{format_answer(items)}."


def _repeat(rng, items, problem):
    if len(items) > MAX_ITEMS:  # keep rambling answers within the task's sequence length
        return None
    return format_answer(items + items[: rng.randint(1, len(items))])


#: Mistakes that keep the format, and mistakes that break it.
CONTENT_CORRUPTIONS = {"drop": _drop, "extra": _extra, "swap": _swap, "replace": _replace,
                       "copy_input": _copy_input, "truncate": _truncate, "repeat": _repeat}
FORMAT_CORRUPTIONS = {"commas": _commas, "chatter": _chatter}
CORRUPTIONS = {**CONTENT_CORRUPTIONS, **FORMAT_CORRUPTIONS}


def corrupt(rng: random.Random, problem: Problem, items: list[int], severity: int) -> str:
    """A response with ``severity`` content mistakes applied to ``items`` (and, with some
    probability when severity >= 2, a broken format on top)."""
    current = list(items)
    for _ in range(severity):
        for _attempt in range(10):
            name = rng.choice(sorted(CONTENT_CORRUPTIONS))
            text = CONTENT_CORRUPTIONS[name](rng, current, problem)
            if text is not None:
                current = [int(x) for x in text.split()]
                break
    if severity >= 2 and rng.random() < 0.3:
        return FORMAT_CORRUPTIONS[rng.choice(sorted(FORMAT_CORRUPTIONS))](rng, current, problem)
    return format_answer(current)


# --------------------------------------------------------------------------- generation

def random_problem(rng: random.Random) -> Problem:
    name = rng.choice(sorted(OPERATIONS))
    while True:
        items = [rng.randint(0, MAX_NUMBER) for _ in range(rng.randint(MIN_ITEMS, MAX_ITEMS))]
        if OPERATIONS[name].accepts(items):
            return Problem(name, tuple(items))


def preference_row(rng: random.Random, problem: Problem) -> dict[str, str]:
    """One row in the Dahoas/rm-static schema with score(chosen) > score(rejected)."""
    prompt, answer = problem.prompt, problem.answer
    kind = rng.random()
    while kind < STYLE_PAIR_FRACTION:
        restyled = FORMAT_CORRUPTIONS[rng.choice(sorted(FORMAT_CORRUPTIONS))](rng, answer, problem)
        if score(prompt, restyled) < 1.0:  # commas around a single number change nothing
            return {"prompt": prompt, "response": format_answer(answer), "chosen": format_answer(answer),
                    "rejected": restyled}
    while True:
        if kind < STYLE_PAIR_FRACTION + CHATTY_CHOSEN_FRACTION:
            # the same chatty style on both sides: style alone must not predict "chosen"
            chosen = _chatter(rng, answer, problem)
            flawed = corrupt(rng, problem, answer, severity=rng.randint(1, 2))
            rejected = _chatter(rng, [int(x) for x in re.findall(r"\d+", flawed)], problem)
        elif rng.random() < CHOSEN_PERFECT_FRACTION:
            chosen = format_answer(answer)
            rejected = corrupt(rng, problem, answer, severity=rng.randint(1, 2))
        else:
            chosen = corrupt(rng, problem, answer, severity=1)
            rejected = corrupt(rng, problem, [int(x) for x in chosen.split()], severity=rng.randint(1, 2))
        if score(prompt, chosen) > score(prompt, rejected):
            return {"prompt": prompt, "response": chosen, "chosen": chosen, "rejected": rejected}


def k_wise_row(rng: random.Random, problem: Problem, k: int = K_WISE_K) -> dict:
    """``k`` responses to one prompt, best first, with strictly decreasing ground-truth scores."""
    prompt, answer = problem.prompt, problem.answer
    while True:
        responses = [format_answer(answer)] + [corrupt(rng, problem, answer, severity=s)
                                               for s in range(1, k)]
        scores = [score(prompt, r) for r in responses]
        ranked = sorted(zip(scores, responses), key=lambda pair: -pair[0])
        if all(a[0] > b[0] for a, b in zip(ranked, ranked[1:])):
            return {"prompt": prompt, "responses": [r for _, r in ranked],
                    "scores": [round(s, 6) for s, _ in ranked]}


def _unique_problems(rng: random.Random, count: int, taken: set[str]) -> list[Problem]:
    problems = []
    while len(problems) < count:
        problem = random_problem(rng)
        if problem.prompt not in taken:
            taken.add(problem.prompt)
            problems.append(problem)
    return problems


def generate_splits(seed: int = DEFAULT_SEED, train_rows: int = TRAIN_ROWS, eval_rows: int = EVAL_ROWS,
                    k_wise_train_rows: int = K_WISE_TRAIN_ROWS,
                    k_wise_eval_rows: int = K_WISE_EVAL_ROWS) -> dict[str, list[dict]]:
    """Every shipped split, deterministically from ``seed``: ``train``, ``eval``,
    ``k_wise_train``, ``k_wise_eval``. No prompt appears twice, within or across splits, so the
    eval splits measure generalisation to unseen lists."""
    rng = random.Random(seed)
    taken: set[str] = set()
    splits = {}
    for name, count, make in (("train", train_rows, preference_row), ("eval", eval_rows, preference_row),
                              ("k_wise_train", k_wise_train_rows, k_wise_row),
                              ("k_wise_eval", k_wise_eval_rows, k_wise_row)):
        splits[name] = [make(rng, problem) for problem in _unique_problems(rng, count, taken)]
    return splits


# --------------------------------------------------------------------------- summaries

def preference_stats(rows: list[dict]) -> dict[str, float]:
    """Ground-truth facts about preference rows: how often chosen beats rejected, mean scores,
    the share of chosen responses that are exactly right, the share that have the right
    numbers in another style, and the share of pure style pairs."""
    chosen = [score(r["prompt"], r["chosen"]) for r in rows]
    rejected = [score(r["prompt"], r["rejected"]) for r in rows]
    right_but_unformatted = [score_components(r["prompt"], r[side])["similarity"] == 1.0
                             and not _WELL_FORMED.match(r[side]) for r in rows for side in ("chosen", "rejected")]
    n = len(rows)
    return {"rows": n,
            # chosen: the right numbers in another style (the demonstrations SFT imitates)
            "chosen_restyled_fraction": sum(right_but_unformatted[0::2]) / n,
            # the bare right answer against the same numbers restyled: a pure style preference
            "style_pair_fraction": sum(c == 1.0 and r for c, r in zip(chosen, right_but_unformatted[1::2])) / n,
            "chosen_beats_rejected_fraction": sum(c > r for c, r in zip(chosen, rejected)) / n,
            "mean_chosen_score": sum(chosen) / n, "mean_rejected_score": sum(rejected) / n,
            "chosen_perfect_fraction": sum(c == 1.0 for c in chosen) / n,
            "chosen_scores": chosen, "rejected_scores": rejected}


def score_ladder(problem: Problem) -> list[dict]:
    """One prompt's correct answer and a named mistake of each kind, with the score of each —
    the scorer at work, for the data chapter."""
    rng = random.Random(0)
    answer = problem.answer
    rows = [{"mistake": "none (correct)", "response": format_answer(answer)}]
    for name, make in CORRUPTIONS.items():
        text = make(rng, answer, problem)
        if text is not None:
            rows.append({"mistake": name, "response": text})
    rows.append({"mistake": "empty", "response": ""})
    for row in rows:
        row.update(score_components(problem.prompt, row["response"]))
    return sorted(rows, key=lambda row: -row["score"])
