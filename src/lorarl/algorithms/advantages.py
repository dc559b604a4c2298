"""GRPO's advantages and reward shaping, computed on the driver from a batch's rewards.

Pure torch on plain tensors, testable with hand-computed numbers.
"""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Outcome advantage per sample: (r - group mean) / (group std + eps), std unbiased.

    Groups whose rewards are all equal (including singletons) get exactly 0: they carry
    no signal about which sample was better, and float round-off must not invent one.
    """
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(
            f"grpo_advantages wants rewards[B] and group_index[B], got "
            f"{tuple(rewards.shape)} and {tuple(group_index.shape)}"
        )
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards.device)
    r = rewards.to(torch.float64)
    _, inv = torch.unique(group_index, return_inverse=True)
    n_groups = int(inv.max()) + 1
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=r.device)
    count = zeros.index_add(0, inv, torch.ones_like(r))
    mean = zeros.index_add(0, inv, r) / count
    dev = r - mean[inv]
    if norm_by_std:
        var = zeros.index_add(0, inv, dev * dev) / (count - 1).clamp(min=1)
        adv = dev / (var.sqrt()[inv] + eps)
    else:
        adv = dev
    hi = torch.full_like(zeros, -torch.inf).scatter_reduce(0, inv, r, "amax")
    lo = torch.full_like(zeros, torch.inf).scatter_reduce(0, inv, r, "amin")
    constant = (hi == lo)[inv]
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.to(out_dtype)


def overlong_penalty(length: int, max_length: int, buffer: int, penalty_factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to max_length - buffer, then falling linearly to
    -penalty_factor at max_length."""
    exceed = length - (max_length - buffer)
    return min(-exceed / buffer * penalty_factor, 0.0) if buffer > 0 else 0.0
