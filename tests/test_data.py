"""The data layer: loading and adapters, data_split, phase tokenization and collators, the
content-keyed cache, the tokenizer, and a clear error for every kind of bad input."""

import json
import os
from pathlib import Path

import pytest
import torch

from dschat_lib import data, tasks, tokenizer as tokenizer_lib

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def fixture_dir(name: str) -> Path:
    return FIXTURES / name.replace("/", "__")


@pytest.fixture(scope="module")
def tok():
    return tokenizer_lib.load_tokenizer()


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"\n\nHuman: Repeat this list: {i} {i + 1} {i + 2}\n\nAssistant:",
             "chosen": f" {i} {i + 1} {i + 2}", "rejected": f" {i} {i + 1}"} for i in range(start, start + n)]


# --------------------------------------------------------------------------- the tokenizer

def test_tokenizer_special_tokens_and_padding_side(tok):
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}) == 3
    assert tok.padding_side == "left"
    ids = tok("\n\nHuman: Reverse this list: 1 2 3\n\nAssistant:")["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.eos_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == "\n\nHuman: Reverse this list: 1 2 3\n\nAssistant:"


def test_the_shipped_tokenizer_by_name(tok):
    assert tokenizer_lib.load_tokenizer("shipped").get_vocab() == tok.get_vocab()


def test_every_number_is_one_token(tok):
    for n in range(tasks.MAX_NUMBER + 1):
        assert len(tok(f" {n}", add_special_tokens=False)["input_ids"]) == 1, n


def test_any_text_round_trips_through_the_byte_level_tokenizer(tok):
    text = " Ünïcødé 🙂 and 1,234"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_a_tokenizer_that_pads_with_eos_is_refused(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["pad_token"] = config["eos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="pad token and eos token share id"):
        tokenizer_lib.load_tokenizer(tmp_path)


# --------------------------------------------------------------------------- loading and adapters

@pytest.mark.parametrize("name", sorted(data.HUB_ADAPTERS))
def test_hub_adapters_map_fixture_rows(name):
    loaded = data.load_preference_data(name, local_dir=fixture_dir(name))
    assert loaded.train and loaded.eval
    for row in loaded.train + loaded.eval:
        assert set(row) == {"prompt", "chosen", "rejected"}
        assert row["prompt"].startswith("\n\nHuman: ") and row["prompt"].endswith("\n\nAssistant:")
        assert row["chosen"].startswith(" ") and row["chosen"] != row["rejected"]
        assert "Assistant:" not in row["chosen"]


def test_adapter_details():
    web = data.load_preference_data("openai/webgpt_comparisons", local_dir=fixture_dir("openai/webgpt_comparisons"))
    assert web.skipped == {"tie": 1}  # equal human scores carry no preference
    everything = web.train + web.eval
    assert len(everything) == 3
    tides = next(r for r in everything if "tides" in r["prompt"])
    assert tides["chosen"] == " Mostly the Moon's gravity, and the Sun's."  # higher score, citations gone
    shp = data.load_preference_data("stanfordnlp/SHP", local_dir=fixture_dir("stanfordnlp/SHP"))
    glass = next(r for r in shp.train if "glass" in r["prompt"])
    assert glass["chosen"].startswith(" No: it is an amorphous solid")  # labels == 0 -> B preferred
    yx = data.load_preference_data("yitingxie/rlhf-reward-datasets",
                                   local_dir=fixture_dir("yitingxie/rlhf-reward-datasets"))
    assert yx.eval[0]["prompt"].endswith("What time zone is London in?\n\nAssistant:")
    assert yx.eval[0]["chosen"] == " GMT, or BST in summer."


def test_hub_dataset_missing_its_schema_fields_names_file_and_row(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"history": "q", "human_ref_A": "a", "human_ref_B": "b", "labels": 1},
                                           {"history": "q", "human_ref_A": "a", "labels": 1}])
    write_jsonl(tmp_path / "validation.jsonl", [{"history": "q", "human_ref_A": "a", "human_ref_B": "b", "labels": 1}])
    with pytest.raises(data.DataError, match=r"train.jsonl, row 2: missing field\(s\) \['human_ref_B'\]"):
        data.load_preference_data("stanfordnlp/SHP", local_dir=tmp_path)


def test_hub_rows_with_no_preference_are_skipped_and_counted(tmp_path):
    good = rows(3)
    same = dict(good[0], rejected=good[0]["chosen"])
    write_jsonl(tmp_path / "train.jsonl", good + [same, dict(good[1], chosen="  ")])
    write_jsonl(tmp_path / "test.jsonl", good)
    loaded = data.load_preference_data("Dahoas/rm-static", local_dir=tmp_path)
    assert len(loaded.train) == 3
    assert loaded.skipped == {"chosen identical to rejected": 1, "empty field": 1}
    with pytest.raises(data.DataError, match="row 4: chosen identical to rejected"):
        data.load_preference_data("Dahoas/rm-static", local_dir=tmp_path, on_invalid="raise")


def test_local_files_json_jsonl_parquet_and_directories(tmp_path):
    import pandas as pd

    write_jsonl(tmp_path / "pairs.jsonl", rows(40))
    (tmp_path / "pairs.json").write_text(json.dumps(rows(40)))
    pd.DataFrame(rows(40)).to_parquet(tmp_path / "pairs.parquet")
    for name in ("pairs.jsonl", "pairs.json", "pairs.parquet"):
        loaded = data.load_preference_data(tmp_path / name)
        assert len(loaded.train) + len(loaded.eval) == 40 and len(loaded.eval) == 2
    directory = tmp_path / "set"
    directory.mkdir()
    write_jsonl(directory / "train.jsonl", rows(5))
    write_jsonl(directory / "test.jsonl", rows(2, start=50))
    loaded = data.load_preference_data(directory)
    assert (len(loaded.train), len(loaded.eval)) == (5, 2)


@pytest.mark.parametrize("bad, message", [
    ({"chosen": " 1", "rejected": " 2"}, "row 2: missing field: 'prompt'"),
    ({"prompt": "p", "chosen": "", "rejected": " 2"}, "row 2: empty field: 'chosen'"),
    ({"prompt": "p", "chosen": " 1", "rejected": None}, "row 2: missing field: 'rejected'"),
    ({"prompt": "p", "chosen": 3, "rejected": " 2"}, "row 2: field not a string: 'chosen'"),
    ({"prompt": "p", "chosen": " 1", "rejected": " 1"}, "row 2: chosen identical to rejected"),
])
def test_bad_local_rows_raise_naming_file_and_row(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [rows(1)[0], bad])
    with pytest.raises(data.DataError) as error:
        data.load_preference_data(path)
    assert str(path) in str(error.value) and message in str(error.value)


def test_unreadable_and_unknown_sources(tmp_path):
    with pytest.raises(data.DataError, match="unknown dataset 'Dahoas/rm-statik'"):
        data.load_preference_data("Dahoas/rm-statik")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(data.DataError, match="empty.jsonl: the file is empty"):
        data.load_preference_data(tmp_path / "empty.jsonl")
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(data.DataError, match="unsupported file type '.csv'"):
        data.load_preference_data(tmp_path / "rows.csv")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "p", "chosen": \n')
    with pytest.raises(data.DataError, match="broken.jsonl: could not be read"):
        data.load_preference_data(tmp_path / "broken.jsonl")


def test_several_datasets_combine():
    names = ["Dahoas/rm-static", "Dahoas/full-hh-rlhf", "stanfordnlp/SHP"]
    dirs = {n: fixture_dir(n) for n in names}
    combined = data.phase_rows(names, "1,0,0", phase=1, local_dirs=dirs)
    singles = [data.load_preference_data(n, local_dir=dirs[n]) for n in names]
    assert len(combined.train) == sum(len(s.train) for s in singles)
    assert {r["prompt"] for r in combined.train} == {r["prompt"] for s in singles for r in s.train}


# --------------------------------------------------------------------------- data_split

def test_parse_data_split():
    assert data.parse_data_split("2,4,4") == pytest.approx((0.2, 0.4, 0.4))
    assert data.parse_data_split("10,0,0") == (1.0, 0.0, 0.0)


@pytest.mark.parametrize("spec, message", [
    ("2,4", "needs three comma-separated weights"), ("1,2,3,4", "needs three"),
    ("a,b,c", "weights must be numbers"), ("2,-4,4", "non-negative"),
    ("0,0,0", "all weights are zero"), ("2,nan,4", "finite"),
])
def test_malformed_data_split_names_the_argument(spec, message):
    with pytest.raises(data.DataError, match=message) as error:
        data.parse_data_split(spec)
    assert f"data_split={spec!r}" in str(error.value)


def test_phase_shares_are_disjoint_complete_and_reproducible():
    shares = [data.phase_indices(1001, "2,4,4", phase, seed=3) for phase in (1, 2, 3)]
    assert [len(s) for s in shares] == [200, 401, 400]  # cut at round(0.2 n), round(0.6 n)
    assert set().union(*shares) == set(range(1001))
    assert sum(len(s) for s in shares) == 1001
    assert data.phase_indices(1001, "2,4,4", 2, seed=3) == shares[1]
    assert data.phase_indices(1001, "2,4,4", 2, seed=4) != shares[1]
    with pytest.raises(data.DataError, match="phase must be one of"):
        data.phase_indices(10, "2,4,4", 4)


def test_a_step_without_a_share_is_an_error():
    with pytest.raises(data.DataError, match="leaves step 2 no training rows"):
        data.phase_rows([data.SHIPPED], "1,0,0", phase=2)


def test_sft_only_data_goes_to_step_one_only(tmp_path):
    extra = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "\n\nHuman: hi\n\nAssistant:", "chosen": " hello"}])
    name = "Dahoas/rm-static"
    step1 = data.phase_rows([name], "1,1,0", 1, sft_only=[extra], local_dirs={name: fixture_dir(name)})
    step2 = data.phase_rows([name], "1,1,0", 2, sft_only=[extra], local_dirs={name: fixture_dir(name)})
    assert any(r["chosen"] == " hello" for r in step1.train)
    assert not any(r["chosen"] == " hello" for r in step2.train)
    with pytest.raises(data.DataError, match="sft_only_data_path 'nope.jsonl': no such file"):
        data.phase_rows([name], "1,1,0", 1, sft_only=["nope.jsonl"], local_dirs={name: fixture_dir(name)})


# --------------------------------------------------------------------------- phases and collators

PAIR = {"prompt": "\n\nHuman: Reverse this list: 1 2 3\n\nAssistant:", "chosen": " 3 2 1", "rejected": " 3 1"}


def test_step1_items_mask_the_prompt_and_end_with_eos(tok):
    (item,), _ = data.tokenize_phase([PAIR], tok, 1, max_seq_len=64)
    prompt_len = len(data.encode_prompt(tok, PAIR["prompt"]))
    assert item["input_ids"][0] == tok.bos_token_id and item["input_ids"][-1] == tok.eos_token_id
    assert item["labels"][:prompt_len] == [data.IGNORE_INDEX] * prompt_len
    assert item["labels"][prompt_len:] == item["input_ids"][prompt_len:]
    assert tok.decode(item["input_ids"][prompt_len:-1]) == " 3 2 1"
    (full,), _ = data.tokenize_phase([PAIR], tok, 1, max_seq_len=64, mask_prompt=False)
    assert full["labels"] == full["input_ids"]


def test_too_long_rows_are_dropped_and_counted(tok):
    items, dropped = data.tokenize_phase([PAIR] * 3, tok, 1, max_seq_len=8)
    assert items == [] and dropped == {"longer than max_seq_len": 3}
    items, dropped = data.tokenize_phase([PAIR], tok, 3, max_seq_len=64, max_prompt_len=5)
    assert items == [] and dropped == {"longer than max_prompt_len": 1}


def test_sft_collator_pads_right_and_ignores_padding(tok):
    items, _ = data.tokenize_phase([PAIR, dict(PAIR, chosen=" 3 2 1 1 1 1")], tok, 1, max_seq_len=64)
    batch = data.SFTCollator(tok.pad_token_id)(items)
    short = len(items[0]["input_ids"])
    assert batch["input_ids"].shape == (2, len(items[1]["input_ids"]))
    assert (batch["input_ids"][0, short:] == tok.pad_token_id).all()
    assert (batch["labels"][0, short:] == data.IGNORE_INDEX).all()
    assert batch["attention_mask"][0].sum() == short


def test_pair_collator_puts_chosen_then_rejected(tok):
    other = dict(PAIR, chosen=" 1 2 3", rejected=" 1 2 3 4")
    items, _ = data.tokenize_phase([PAIR, other], tok, 2, max_seq_len=64)
    batch = data.PairCollator(tok.pad_token_id)(items)
    assert batch["input_ids"].shape[0] == 4
    decoded = tok.batch_decode(batch["input_ids"], skip_special_tokens=True)
    assert [d.split("Assistant:")[1] for d in decoded] == [" 3 2 1", " 1 2 3", " 3 1", " 1 2 3 4"]
    assert batch["prompt_len"].tolist() == [items[0]["prompt_len"]] * 2


def test_k_wise_collator_keeps_groups_together(tok):
    group = {"prompt": PAIR["prompt"], "responses": [" 3 2 1", " 3 2", " 3", " 1, 2"]}
    items, _ = data.tokenize_k_wise([group, group], tok, max_seq_len=64)
    batch = data.KWiseCollator(tok.pad_token_id)(items)
    assert batch["input_ids"].shape[0] == 8 and batch["group_size"] == 4
    assert torch.equal(batch["input_ids"][:4], batch["input_ids"][4:])
    with pytest.raises(data.DataError, match="same k"):
        data.KWiseCollator(tok.pad_token_id)([items[0], {"sequences": items[0]["sequences"][:2], "prompt_len": 1}])


def test_prompt_collator_left_pads_to_max_prompt_len(tok):
    items, _ = data.tokenize_phase([PAIR, dict(PAIR, prompt=PAIR["prompt"].replace("1 2 3", "1 2 3 4 5"))],
                                   tok, 3, max_seq_len=64, max_prompt_len=32)
    batch = data.PromptCollator(tok.pad_token_id, 32)(items)
    assert batch["input_ids"].shape == (2, 32)
    assert (batch["input_ids"][:, -1] != tok.pad_token_id).all()  # every prompt ends at the edge
    assert batch["input_ids"][0, 0] == tok.pad_token_id
    assert batch["prompt"][0] == PAIR["prompt"]


def test_build_phase_data_on_the_shipped_task(tok, tmp_path):
    sizes = {}
    for phase in (1, 2, 3):
        built = data.build_phase_data(phase, tok, cache_dir=tmp_path, max_seq_len=64, max_prompt_len=32)
        sizes[phase] = built.stats["train_rows"]
        assert built.stats["train_items"] == built.stats["train_rows"]  # nothing too long
        loader = data.dataloader(built, batch_size=4)
        batch = next(iter(loader))
        assert batch["input_ids"].shape[0] == (8 if phase == 2 else 4)
    total = len(data.load_shipped("train"))
    assert sum(sizes.values()) == total
    assert sizes[1] == pytest.approx(0.2 * total, abs=1)


def test_build_k_wise_data(tok, tmp_path):
    built = data.build_k_wise_data(tok, cache_dir=tmp_path)
    batch = next(iter(data.dataloader(built, batch_size=2)))
    assert batch["input_ids"].shape[0] == 2 * batch["group_size"]


# --------------------------------------------------------------------------- the cache

def _source(tmp_path, content):
    directory = tmp_path / "src"
    directory.mkdir(exist_ok=True)
    write_jsonl(directory / "train.jsonl", content)
    write_jsonl(directory / "eval.jsonl", rows(4, start=500))
    return directory


def test_cache_hits_on_identical_inputs_and_misses_on_a_changed_row(tok, tmp_path):
    cache = tmp_path / "cache"
    source = _source(tmp_path, rows(30))
    first = data.build_phase_data(1, tok, [source], data_split="1,0,0", cache_dir=cache)
    again = data.build_phase_data(1, tok, [source], data_split="1,0,0", cache_dir=cache)
    assert not first.stats["cache_hit"] and again.stats["cache_hit"]
    assert [i["input_ids"] for i in again.train] == [i["input_ids"] for i in first.train]
    changed = rows(30)
    changed[7]["chosen"] = " 7 8 99"  # one edited row, same file name, same size class
    _source(tmp_path, changed)
    edited = data.build_phase_data(1, tok, [source], data_split="1,0,0", cache_dir=cache)
    assert not edited.stats["cache_hit"]
    other_split = data.build_phase_data(1, tok, [source], data_split="1,1,2", cache_dir=cache)
    assert not other_split.stats["cache_hit"]
    assert not list(cache.glob("*.tmp"))  # atomic writes leave no temporary files


def test_cache_misses_when_the_tokenizer_changes(tok, tmp_path):
    cache = tmp_path / "cache"
    source = _source(tmp_path, rows(30))
    data.build_phase_data(1, tok, [source], data_split="1,0,0", cache_dir=cache)
    smaller = tokenizer_lib.train_tokenizer(tokenizer_lib.training_corpus(rows(30)), vocab_size=300)
    rebuilt = data.build_phase_data(1, smaller, [source], data_split="1,0,0", cache_dir=cache)
    assert not rebuilt.stats["cache_hit"]


def _cache_rank(rank, world, init_file, cache_dir, log_dir):
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)

    def build():
        Path(log_dir, f"built-by-{rank}").write_text("")
        return {"value": 42}

    value, _ = data.cached({"k": 1}, build, cache_dir)
    Path(log_dir, f"read-by-{rank}").write_text(json.dumps(value))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_with_several_ranks_only_rank_zero_builds(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_cache_rank, args=(2, str(tmp_path / "init"), str(tmp_path / "cache"), str(tmp_path)),
                       nprocs=2, start_method="spawn")
    assert sorted(p.name for p in tmp_path.glob("built-by-*")) == ["built-by-0"]
    assert [json.loads((tmp_path / f"read-by-{r}").read_text()) for r in (0, 1)] == [{"value": 42}] * 2
