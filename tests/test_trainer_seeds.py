"""Rollout sampling seeds: one per (run seed, step, data-parallel shard), all distinct."""

from __future__ import annotations

from lorarl.driver.rollouts import sampling_seed


def test_seeds_differ_across_shards_and_steps_and_repeat_per_run():
    grid = {(step, shard): sampling_seed(1, step, shard) for step in range(1, 201) for shard in range(8)}
    assert len(set(grid.values())) == len(grid)  # seed + step + shard collided along diagonals
    assert sampling_seed(1, 5, 2) == grid[(5, 2)]  # a resumed run draws what the first one would have
    assert sampling_seed(2, 5, 2) != grid[(5, 2)]
    assert all(0 <= s < 2**32 for s in grid.values())
