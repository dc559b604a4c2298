import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lorarl.data.arith import corpus, held_out_rows, make_rows, pairs, question
from lorarl.data.dataset import (
    PromptItem,
    PromptLoader,
    build_prompts,
    ensure_arith_parquet,
    load_rows,
    write_parquet,
)
from lorarl.errors import DataError

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus() + ["user assistant system"], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=special,
        chat_template=CHAT_TEMPLATE,
    )


def _rows(texts):
    return [
        {
            "data_source": "arith",
            "prompt": [{"role": "user", "content": t}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"index": i},
        }
        for i, t in enumerate(texts)
    ]


# ---------------------------------------------------------------- parquet io


def test_write_and_load_roundtrip_multiple_files(tmp_path):
    a = write_parquet(make_rows(3, 0, "train"), tmp_path / "sub" / "a.parquet")
    b = write_parquet(make_rows(2, 0, "test"), tmp_path / "b.parquet")
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]
    rows = load_rows([str(a), str(b)])
    assert len(rows) == 5
    assert rows[0]["prompt"][0]["role"] == "user"
    assert rows[0]["reward_model"]["ground_truth"] == make_rows(3, 0, "train")[0]["reward_model"]["ground_truth"]
    assert rows[3]["extra_info"]["split"] == "test"
    assert load_rows(str(b)) == rows[3:]


def test_load_rows_missing_file_says_what_to_do(tmp_path):
    missing = tmp_path / "nope.parquet"
    with pytest.raises(DataError, match=r"nope\.parquet.*prepare_gsm8k\.py.*data\.train_files"):
        load_rows([str(missing)])


def test_load_rows_unreadable_file(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_text("this is not parquet")
    with pytest.raises(DataError, match=r"bad\.parquet"):
        load_rows(str(bad))


def test_load_rows_missing_columns(tmp_path):
    path = tmp_path / "cols.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"style": "rule"}}]), path
    )
    with pytest.raises(DataError, match=r"cols\.parquet.*data_source.*reward_model\.ground_truth"):
        load_rows(str(path))


# ---------------------------------------------------------------- prompts


def test_build_prompts_uses_chat_template(tokenizer):
    rows = make_rows(4, 1, "train")
    items, n_filtered = build_prompts(rows, tokenizer, 64, filter_overlong_prompts=True, truncation="error")
    assert n_filtered == 0 and len(items) == 4
    item = items[2]
    assert isinstance(item, PromptItem)
    assert isinstance(item.prompt_ids, list) and all(type(t) is int for t in item.prompt_ids)
    text = tokenizer.decode(item.prompt_ids)
    assert text == f"<|im_start|>user\n{rows[2]['prompt'][0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    assert item.index == 2
    assert item.data_source == "arith"
    assert item.ground_truth == rows[2]["reward_model"]["ground_truth"]
    assert item.extra_info == rows[2]["extra_info"]
    assert item.messages == rows[2]["prompt"]


def _lengths(tokenizer, rows):
    return [
        len(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False))
        for r in rows
    ]


def test_overlong_prompts_filter_truncate_or_error(tokenizer):
    rows = _rows(["What is 1 + 2?", "What is 1 + 2? " * 8, "What is 3 + 4?"])
    lengths = _lengths(tokenizer, rows)
    limit = max(lengths[0], lengths[2])
    assert lengths[1] > limit

    items, n = build_prompts(rows, tokenizer, limit, filter_overlong_prompts=True, truncation="error")
    assert n == 1 and [it.index for it in items] == [0, 2]

    full = tokenizer.apply_chat_template(
        rows[1]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    left, _ = build_prompts(rows, tokenizer, limit, filter_overlong_prompts=False, truncation="left")
    right, _ = build_prompts(rows, tokenizer, limit, filter_overlong_prompts=False, truncation="right")
    assert left[1].prompt_ids == full[-limit:]
    assert right[1].prompt_ids == full[:limit]
    assert left[0].prompt_ids == right[0].prompt_ids and len(left[0].prompt_ids) == lengths[0]

    msg = (
        rf"row 1.*{lengths[1]}.*data\.max_prompt_length={limit}.*data\.filter_overlong_prompts"
        rf".*data\.truncation"
    )
    with pytest.raises(DataError, match=msg):
        build_prompts(rows, tokenizer, limit, filter_overlong_prompts=False, truncation="error")


def test_all_filtered_is_an_error(tokenizer):
    with pytest.raises(DataError, match=r"data\.max_prompt_length=3"):
        build_prompts(_rows(["What is 1 + 2?"]), tokenizer, 3, filter_overlong_prompts=True)


def test_bad_prompt(tokenizer):
    # data.truncation itself is checked by the config (tests/test_config.py).
    rows = _rows(["ok"])
    rows[0]["prompt"] = "a bare string"
    with pytest.raises(DataError, match="row 0"):
        build_prompts(rows, tokenizer, 64, False)


def test_build_prompts_reads_parquet_rows_with_int_ground_truth(tmp_path, tokenizer):
    rows = _rows(["What is 2 + 2?"])
    rows[0]["reward_model"]["ground_truth"] = 4  # some exports store numbers
    path = write_parquet(rows, tmp_path / "d.parquet")
    items, _ = build_prompts(load_rows(str(path)), tokenizer, 64, False)
    assert items[0].ground_truth == "4"


# ---------------------------------------------------------------- loader


def _items(n):
    return [PromptItem(index=i, prompt_ids=[i], data_source="arith", ground_truth=str(i)) for i in range(n)]


def _ids(batch):
    return [it.index for it in batch]


def test_loader_epochs_cover_items_and_reshuffle():
    loader = PromptLoader(_items(10), batch_size=3, shuffle=True, seed=7)
    assert loader.steps_per_epoch == 3 and len(loader) == 3
    epoch0 = [_ids(b) for b in loader]
    assert loader.epoch == 1 and loader.state_dict() == {"epoch": 1, "batch_in_epoch": 0}
    epoch1 = [_ids(b) for b in loader]
    assert len(epoch0) == 3 and all(len(b) == 3 for b in epoch0)
    flat0 = sum(epoch0, [])
    assert len(set(flat0)) == 9  # drop_last leaves one item out, no repeats
    assert flat0 != sum(epoch1, [])  # seed + epoch reshuffles
    same_seed = PromptLoader(_items(10), batch_size=3, shuffle=True, seed=7)
    assert [_ids(b) for b in same_seed] == epoch0
    other_seed = PromptLoader(_items(10), batch_size=3, shuffle=True, seed=8)
    assert [_ids(b) for b in other_seed] != epoch0


def test_loader_no_shuffle_keep_last():
    loader = PromptLoader(_items(5), batch_size=2, shuffle=False, seed=0, drop_last=False)
    assert loader.steps_per_epoch == 3
    assert [_ids(b) for b in loader] == [[0, 1], [2, 3], [4]]
    assert [_ids(loader.next_batch()) for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]
    assert loader.epoch == 2


def test_loader_resume_matches_uninterrupted_run():
    ref = PromptLoader(_items(11), batch_size=4, shuffle=True, seed=3)
    uninterrupted = [_ids(ref.next_batch()) for _ in range(8)]  # 2 per epoch -> 4 epochs

    for stop in range(8):
        first = PromptLoader(_items(11), batch_size=4, shuffle=True, seed=3)
        got = [_ids(first.next_batch()) for _ in range(stop)]
        state = first.state_dict()
        resumed = PromptLoader(_items(11), batch_size=4, shuffle=True, seed=3)
        resumed.load_state_dict(dict(state))
        got += [_ids(resumed.next_batch()) for _ in range(8 - stop)]
        assert got == uninterrupted, stop

    mid = PromptLoader(_items(11), batch_size=4, shuffle=True, seed=3)
    mid.load_state_dict({"epoch": 1, "batch_in_epoch": 1})
    assert [_ids(b) for b in mid] == [uninterrupted[3]]  # iteration yields the rest of the epoch


def test_loader_errors():
    with pytest.raises(DataError, match=r"data\.train_batch_size=11"):
        PromptLoader(_items(10), batch_size=11, shuffle=False, seed=0)
    loader = PromptLoader(_items(10), batch_size=5, shuffle=False, seed=0)
    with pytest.raises(DataError, match=r"data\.train_batch_size"):
        loader.load_state_dict({"epoch": 0, "batch_in_epoch": 2})


# ---------------------------------------------------------------- synthetic task files


def test_ensure_arith_parquet_writes_once(tmp_path):
    train, val = ensure_arith_parquet(tmp_path / "arith" / "train.parquet", tmp_path / "arith" / "val.parquet", 12, 1)
    train_rows, val_rows = load_rows(train), load_rows(val)
    assert train_rows == make_rows(12, 1, "train", pool="train")
    assert val_rows == held_out_rows() and {r["extra_info"]["split"] for r in val_rows} == {"test"}
    mtime = os.stat(train).st_mtime_ns
    assert ensure_arith_parquet(train, val, 12, 1) == (train, val)
    assert os.stat(train).st_mtime_ns == mtime  # existing files are reused, not rewritten
    assert not list((tmp_path / "arith").glob("*.tmp*"))  # nothing half-written left beside them


def test_arith_held_out_pairs_are_never_in_the_warmup():
    warm, held = set(pairs("warmup")), set(pairs("heldout"))
    assert len(held) == 40 and len(warm) == 60 and not warm & held and warm | held == set(pairs("all"))
    assert pairs("heldout") == pairs("heldout")  # a fixed split, the same in every process
    drawn = {
        (r["prompt"][0]["content"], r["reward_model"]["ground_truth"]) for r in make_rows(500, 0, "x", pool="warmup")
    }
    assert drawn <= {(question(a, b), str(a + b)) for a, b in warm}
    assert {r["prompt"][0]["content"] for r in held_out_rows()} == {question(a, b) for a, b in held}


def test_default_task_validation_prompts_are_not_training_prompts(tmp_path):
    """The default run's files, as the generator writes them: no validation prompt is a training
    prompt, so held-out accuracy measures sums GRPO never trained on."""
    from lorarl.config.compose import compose

    cfg = compose(["+backend=fsdp"])
    train, val = ensure_arith_parquet(
        tmp_path / "train.parquet", tmp_path / "val.parquet", cfg.data.generator_size, seed=0
    )
    train_prompts = {r["prompt"][0]["content"] for r in load_rows(train)}
    val_prompts = [r["prompt"][0]["content"] for r in load_rows(val)]
    assert len(val_prompts) == len(set(val_prompts)) == 40
    assert not train_prompts & set(val_prompts), sorted(train_prompts & set(val_prompts))[:5]
    every = {question(a, b) for a in range(10) for b in range(10)}
    assert train_prompts | set(val_prompts) == every  # every other sum is trained on


def test_prompt_batches_are_the_trainers_batches(tokenizer, tmp_path):
    from types import SimpleNamespace

    from lorarl.data.batches import prompt_batches

    train, val = ensure_arith_parquet(tmp_path / "train.parquet", tmp_path / "val.parquet", n_train=40, seed=0)
    data = SimpleNamespace(
        train_files=[train], val_files=[val], max_prompt_length=64, filter_overlong_prompts=True,
        truncation="error", train_batch_size=8, gen_batch_size=None, shuffle=True,
    )  # fmt: skip
    loader, val_items, dropped = prompt_batches(data, tokenizer, seed=3, validation=False)
    assert (len(loader.items), val_items, dropped) == (40, [], 0)
    items, _ = build_prompts(load_rows([train]), tokenizer, 64, True)
    expected = PromptLoader(items, 8, shuffle=True, seed=3)
    for _ in range(6):  # past the first epoch's 5 batches: the reshuffle follows the seed too
        assert [i.index for i in loader.next_batch()] == [i.index for i in expected.next_batch()]
    _, val_items, _ = prompt_batches(data, tokenizer, seed=3, validation=True)
    assert [i.index for i in val_items] == list(range(len(load_rows([val]))))
