"""Under torchrun (gloo, two ranks): `lorarl.rollout.sleep.all_ranks` is true on every rank only when
every rank passes true, as the sleep plan's switch to awake needs (one rank that does not fit
keeps every rank asleep).

    torchrun --standalone --nproc_per_node=2 tests/distributed/all_ranks_check.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lorarl.rollout.sleep import all_ranks


def main() -> None:
    dist.init_process_group("gloo")
    rank, cpu = dist.get_rank(), torch.device("cpu")
    assert all_ranks(True, cpu)
    assert not all_ranks(rank == 0, cpu)  # rank 1 says no: both hear no
    assert not all_ranks(rank == 1, cpu)
    assert not all_ranks(False, cpu)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
