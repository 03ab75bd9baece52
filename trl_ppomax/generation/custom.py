"""Rollouts written by the user's ``rollout_func`` (TRL ``GRPOTrainer``'s contract): ``rollout_func(prompts, trainer)
-> {"prompt_ids", "completion_ids", "logprobs", optional "env_mask", ...}``, one entry per completion,
``num_samples_per_prompt`` completions per prompt in a row per prompt. ``env_mask`` marks, per completion token, what
the policy wrote (1) and what an environment or tool inserted (0): those tokens are attended to but never trained on
(:attr:`~trl_ppomax.ppo.experience.Rollout.policy_mask`). Other keys are forwarded to the reward functions, as
columns. The trainer scores the trajectories with its own forwards; ``logprobs`` (the sampler's, 0 where the
environment wrote) corrects for another sampler with ``rollout_func_importance_sampling``, else it is checked only."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from trl_ppomax.generation import Generated

__all__ = ["REQUIRED_KEYS", "custom_rollout", "padded"]

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")


def custom_rollout(
    rollout_func: Callable, prompts: Sequence, trainer, samples_per_prompt: int, pad_token_id: int, device
):
    """Call ``rollout_func(prompts, trainer)`` and check its output (clear errors naming the key and the fix): a
    :class:`~trl_ppomax.generation.Generated` of N = B·n rows, its ``columns`` the extra keys."""
    output = rollout_func(list(prompts), trainer)
    if not isinstance(output, dict):
        raise TypeError(f"rollout_func must return a dict with the keys {list(REQUIRED_KEYS)}; got {type(output)}.")
    missing = [key for key in REQUIRED_KEYS if key not in output]
    if missing:
        raise ValueError(
            f"rollout_func must return the keys {list(REQUIRED_KEYS)} (and optionally 'env_mask'); {missing} missing."
        )
    rows = len(prompts) * samples_per_prompt
    completions = [list(ids) for ids in output["completion_ids"]]
    for key in (*REQUIRED_KEYS, "env_mask"):
        if key in output and len(output[key]) != rows:
            raise ValueError(
                f"rollout_func returned {len(output[key])} '{key}' for {len(prompts)} prompts × "
                f"num_samples_per_prompt={samples_per_prompt}: one per completion ({rows}) is needed."
            )
    _check_per_token(output, completions)
    query_ids, query_mask = padded([list(ids) for ids in output["prompt_ids"]], pad_token_id, "left")
    response_ids, response_mask = padded(completions, pad_token_id, "right")
    env_mask = None
    if "env_mask" in output:
        env_mask = padded([list(m) for m in output["env_mask"]], 0, "right")[0] * response_mask
    extra = {
        key: _per_completion(value, rows) for key, value in output.items() if key not in (*REQUIRED_KEYS, "env_mask")
    }
    logprobs = torch.zeros(response_ids.shape)
    for row, values in enumerate(output["logprobs"]):
        logprobs[row, : len(values)] = torch.as_tensor([float(v) for v in values])
    tensors = (query_ids, query_mask, response_ids, response_mask, logprobs)
    env_mask = None if env_mask is None else env_mask.to(device)
    return Generated(*(t.to(device) for t in tensors), env_mask, extra)


def _check_per_token(output: dict, completions: list[list[int]]) -> None:
    """``logprobs`` and ``env_mask`` hold one entry per completion token; ``env_mask`` is 0/1; a completion has one."""
    for row, ids in enumerate(completions):
        if not ids:
            raise ValueError(f"rollout_func returned an empty completion (row {row}): every row needs a token.")
        for key in ("logprobs", "env_mask"):
            if key in output and len(output[key][row]) != len(ids):
                raise ValueError(
                    f"rollout_func's '{key}' row {row} has {len(output[key][row])} entries for {len(ids)} completion "
                    "tokens: one per token is needed."
                )
        if "env_mask" in output and not set(output["env_mask"][row]) <= {0, 1}:
            raise ValueError(f"rollout_func's 'env_mask' row {row} must hold 0 (environment) or 1 (policy) only.")


def padded(rows: list[list[int]], value: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` as (N, max length) ids padded with ``value`` on ``side``, and the mask of the real entries."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, span], mask[i, span] = torch.as_tensor(row, dtype=torch.long), 1
    return ids, mask


def _per_completion(value, rows: int) -> list:
    """An extra key as a column: a list of one value per completion, or one value for all."""
    return list(value) if isinstance(value, list | tuple) and len(value) == rows else [value] * rows
