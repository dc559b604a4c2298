"""The token-share task: its reward over token ids, its data generator, and ids reaching the scorers."""

from __future__ import annotations

import os

import pytest

from lorarl.config.compose import load_group
from lorarl.config.schema import RewardConfig
from lorarl.data import token_share as task
from lorarl.data.dataset import PromptItem, build_prompts, load_rows
from lorarl.driver.evaluation import validation_metrics
from lorarl.errors import DataError
from lorarl.rewards import RESPONSE_IDS, check_items, compute_score, get_reward_fn, token_share

# Subset 0's members among ids 0-63, recorded when the subset was defined: a changed hash changes
# which ids every earlier run rewarded, and must fail here.
SUBSET_0_BELOW_64 = [7, 17, 20, 34, 37, 38, 52, 55]
# Qwen2.5/Qwen3 tokenizers' <|endoftext|>, <|im_start|>, <|im_end|>.
QWEN_SPECIAL_IDS = (151643, 151644, 151645)


def test_subset_is_one_id_in_eight_in_any_vocabulary():
    for vocab, tol in ((152064, 0.005), (576, 0.03)):  # Qwen2.5-7B's vocabulary, the tiny model's
        share = sum(token_share.in_subset(i, 0) for i in range(vocab)) / vocab
        assert abs(share - 1 / 8) < tol, (vocab, share)
    zero = {i for i in range(4096) if token_share.in_subset(i, 0)}
    one = {i for i in range(4096) if token_share.in_subset(i, 1)}
    assert abs(len(zero & one) / len(zero) - 1 / 8) < 0.05  # another seed is another, independent subset


def test_subset_0_is_pinned_and_leaves_out_the_ids_that_end_a_response():
    from lorarl.models.tiny import build_tokenizer

    assert [i for i in range(64) if token_share.in_subset(i, 0)] == SUBSET_0_BELOW_64
    # An end-of-text id in the subset would pay a one-token response in full: a shortcut, not a signal.
    tiny_special = build_tokenizer().all_special_ids
    assert tiny_special and not any(token_share.in_subset(i, task.SUBSET_SEED) for i in tiny_special)
    assert not any(token_share.in_subset(i, task.SUBSET_SEED) for i in QWEN_SPECIAL_IDS)


def test_the_subset_direction_lets_one_hidden_shift_raise_the_whole_subset():
    """A random output layer with Qwen's vocabulary, the subset given its direction: only the
    subset's rows move, all by one vector of the rows' mean norm; at random hidden states the
    subset still holds about 1/8 of the probability, and a shift of half the hidden norm along
    the direction gives it most. Without the direction, the same shift along the subset's own
    mean row (the best one direction can do) leaves it near 1/8."""
    import torch

    torch.manual_seed(0)
    plain = torch.randn(151936, 256) * 0.02
    weight = plain.clone()
    task.give_subset_a_direction(weight)
    subset = torch.tensor([token_share.in_subset(i, task.SUBSET_SEED) for i in range(len(plain))])
    moved = weight - plain
    assert torch.equal(moved.abs().sum(dim=1) > 0, subset)
    shared = moved[subset][0]
    assert torch.allclose(moved[subset], shared.expand(int(subset.sum()), -1))
    assert abs(shared.norm() / plain.norm(dim=1).mean() - 1.0) < 1e-4

    hidden = torch.randn(128, 256)  # after the final RMSNorm: entries of about 1
    shift = 0.5 * 256**0.5

    def subset_mass(w: torch.Tensor, h: torch.Tensor) -> float:
        return float(torch.softmax(h @ w.T, dim=-1)[:, subset].sum(dim=-1).mean())

    best_plain = plain[subset].mean(0) - plain.mean(0)
    assert abs(subset_mass(weight, hidden) - 1 / 8) < 0.02
    assert subset_mass(weight, hidden + shift * shared / shared.norm()) > 0.5
    assert subset_mass(plain, hidden + shift * best_plain / best_plain.norm()) < 0.14


def test_score_is_the_share_of_subset_ids():
    members = SUBSET_0_BELOW_64
    assert token_share.score(members[:3] + [0], "0") == 0.75
    assert token_share.score(members, " 0 ") == 1.0
    assert token_share.score([0, 1, 2, 3], "0") == 0.0
    assert token_share.score([], "0") == 0.0


def test_the_registry_reads_the_ids_from_extra_info_and_says_when_they_are_missing():
    fn = get_reward_fn("token_share")
    assert fn("the text is not read", "0", {"index": 3, RESPONSE_IDS: [7, 1]}) == 0.5
    with pytest.raises(DataError, match=r"extra_info\['response_ids'\] is missing"):
        compute_score("token_share", "some text", "0")
    for bad in ("x", "-1", "1.5"):
        with pytest.raises(DataError, match="token_share ground_truth .* subset seed"):
            fn("", bad, {RESPONSE_IDS: [7]})
    item = PromptItem(index=4, prompt_ids=[1], data_source="token_share", ground_truth="seven")
    with pytest.raises(DataError, match="data row 4 .*token_share"):
        check_items([item])


def test_validation_passes_the_ids_to_the_scorer():
    item = PromptItem(index=0, prompt_ids=[1], data_source="token_share", ground_truth="0")
    reward = load_group(RewardConfig, "reward/default")
    out = validation_metrics([item], [["a", "b"]], reward, token_ids=[[[7, 17], [7, 1]]])
    assert out["val/token_share/reward/mean"] == 0.75
    assert out["val/token_share/acc/mean@2"] == 0.5  # the all-subset sample is the one "right"
    with pytest.raises(ValueError, match="one list of ids per response"):
        validation_metrics([item], [["a", "b"]], reward, token_ids=[[[7]]])


def test_generator_writes_the_task_once_in_verl_schema(tmp_path):
    from lorarl.models.tiny import build_tokenizer

    folder = tmp_path / "token_share"
    train, val = task.ensure_parquet(folder / "train.parquet", folder / "val.parquet", n_train=40, seed=0)
    rows, val_rows = load_rows(train), load_rows(val)
    assert rows == task.make_rows(40, 0, "train") and len(val_rows) == task.N_VAL
    assert rows != task.make_rows(40, 1, "train")  # the seed picks the prompts
    assert len({r["prompt"][0]["content"] for r in rows + val_rows}) == 40 + task.N_VAL  # all differ
    assert {r["data_source"] for r in rows} == {"token_share"}
    assert {r["reward_model"]["ground_truth"] for r in rows} == {str(task.SUBSET_SEED)}
    mtime = os.stat(train).st_mtime_ns
    assert task.ensure_parquet(train, val, 40, 0) == (train, val) and os.stat(train).st_mtime_ns == mtime
    assert not list(folder.glob("*.tmp*"))
    # Every prompt fits conf/data/token_share.yaml's max_prompt_length (64) with the tiny model's tokenizer.
    items, dropped = build_prompts(rows + val_rows, build_tokenizer(), 64, filter_overlong_prompts=False)
    assert dropped == 0 and max(len(i.prompt_ids) for i in items) <= 64
    check_items(items)
