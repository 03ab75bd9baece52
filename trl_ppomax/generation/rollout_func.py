"""Rollouts written by the user's ``rollout_func`` (TRL ``GRPOTrainer``'s contract): ``rollout_func(prompts, trainer)
-> {"prompt_ids", "completion_ids", "logprobs", optional "env_mask", ...}``, as TRL calls it: ``prompts`` holds each of
the batch's prompts ``num_samples_per_prompt`` times in a row (TRL's ``num_generations``), and the output one entry
per given prompt. ``env_mask`` marks, per completion token, what
the policy wrote (1) and what an environment or tool inserted (0): those tokens are attended to but never trained on
(:attr:`~trl_ppomax.base.rollout.Rollout.policy_mask`). Other keys are forwarded to the reward functions, as
columns (a key that clashes with what they already receive is refused). The trainer scores the trajectories with its
own forwards; ``logprobs`` (the sampler's, 0 where the environment wrote) corrects for another sampler with
``rollout_func_importance_sampling`` (then they must be finite and ≤ 0), else it is checked only. Lists, tuples,
tensors and numpy arrays are all taken; ids are checked against the vocabulary and the context."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence

import torch

from trl_ppomax.base.rollout import Generated

__all__ = ["REQUIRED_KEYS", "REWARD_KEYWORDS", "call_rollout_func", "padded"]

logger = logging.getLogger(__name__)
REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")
#: What a reward function already receives (:func:`~trl_ppomax.rewards.functions.call_reward_function`), besides the
#: dataset's columns: an extra key of these names would silently replace it.
REWARD_KEYWORDS = ("prompt", "prompts", "completions", "sequence_texts", "environments")
#: Log-probs above this are impossible (≤ 0), beyond a low-precision sampler's rounding.
_LOGPROB_ROUNDING = 1e-2


def call_rollout_func(
    rollout_func: Callable,
    prompts: Sequence,
    trainer,
    samples_per_prompt: int,
    pad_token_id: int,
    device,
    *,
    columns: Collection[str] = (),
    vocab_size: int | None = None,
    context_length: int | None = None,
    importance_sampling: bool = False,
):
    """Call ``rollout_func(prompts, trainer)``, each prompt repeated ``samples_per_prompt`` times, and check its output (clear errors naming the key and the fix): a
    :class:`~trl_ppomax.base.rollout.Generated` of N = B·n rows, its ``columns`` the extra keys. Refused: an extra key
    named as a dataset column (``columns``) or one of :data:`REWARD_KEYWORDS`, an id outside ``[0, vocab_size)``, a
    prompt and completion longer than ``context_length``, and (``importance_sampling``) log-probs that are not finite
    or above 0."""
    given = [prompt for prompt in prompts for _ in range(samples_per_prompt)]  # as TRL passes them
    output = rollout_func(given, trainer)
    if not isinstance(output, dict):
        raise TypeError(f"rollout_func must return a dict with the keys {list(REQUIRED_KEYS)}; got {type(output)}.")
    missing = [key for key in REQUIRED_KEYS if key not in output]
    if missing:
        raise ValueError(
            f"rollout_func must return the keys {list(REQUIRED_KEYS)} (and optionally 'env_mask'); {missing} missing."
        )
    output = {key: _as_lists(value) if key in (*REQUIRED_KEYS, "env_mask") else value for key, value in output.items()}
    _check_extra_keys(output, columns)
    rows = len(given)
    _check_counts(output, rows, samples_per_prompt)
    completions = [list(ids) for ids in output["completion_ids"]]
    _check_per_token(output, completions)
    query_ids, query_mask = padded([list(ids) for ids in output["prompt_ids"]], pad_token_id, "left")
    response_ids, response_mask = padded(completions, pad_token_id, "right")
    _check_ids((query_ids, query_mask), (response_ids, response_mask), vocab_size, context_length)
    env_mask = None
    if "env_mask" in output:
        env_mask = padded([list(m) for m in output["env_mask"]], 0, "right")[0] * response_mask
        if not env_mask.any():
            logger.warning(
                "rollout_func's env_mask is 0 on every completion token: nothing of this batch is the policy's, so "
                "it trains on nothing. Mark the tokens the policy wrote with 1 (0 only where a tool or environment "
                "inserted them)."
            )
    extra = {
        key: _per_completion(value, rows) for key, value in output.items() if key not in (*REQUIRED_KEYS, "env_mask")
    }
    logprobs = torch.zeros(response_ids.shape)
    for row, values in enumerate(output["logprobs"]):
        logprobs[row, : len(values)] = torch.as_tensor([float(v) for v in values])
    if importance_sampling:
        _check_logprobs(logprobs, response_mask)
    tensors = (query_ids, query_mask, response_ids, response_mask, logprobs)
    env_mask = None if env_mask is None else env_mask.to(device)
    return Generated(*(t.to(device) for t in tensors), env_mask, extra)


def _check_counts(output: dict, rows: int, samples_per_prompt: int) -> None:
    """One entry of each required key (and ``env_mask``) per prompt given."""
    for key in (*REQUIRED_KEYS, "env_mask"):
        if key in output and len(output[key]) != rows:
            raise ValueError(
                f"rollout_func returned {len(output[key])} '{key}' for the {rows} prompts it was given (the batch's "
                f"{rows // samples_per_prompt} prompts, each repeated num_samples_per_prompt={samples_per_prompt} "
                "times, as TRL passes them): one completion per prompt given is needed."
            )


def _as_lists(value):
    """A required key's (or ``env_mask``'s) tensor or numpy array, or list of them (one per completion), as nested
    Python lists; anything else as is."""
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        return value.tolist()
    if isinstance(value, list | tuple) and value and all(hasattr(v, "tolist") for v in value):
        return [v.tolist() for v in value]
    return value


def _check_extra_keys(output: dict, columns: Collection[str]) -> None:
    """An extra key must not replace what the reward functions receive (TRL raises for these too)."""
    for key in output:
        if key in (*REQUIRED_KEYS, "env_mask"):
            continue
        if key in REWARD_KEYWORDS or key in columns:
            what = "a dataset column" if key in columns else "what reward functions receive"
            raise ValueError(
                f"rollout_func returned the extra key {key!r}, which is {what}: passed on to the reward functions, "
                f"it would replace it. Rename the key (e.g. {'rollout_' + key!r})."
            )


def _check_ids(prompts: tuple, completions: tuple, vocab_size: int | None, context: int | None) -> None:
    """Every real id of the padded ``(ids, mask)`` prompts and completions in ``[0, vocab_size)`` (an id beyond it
    fails inside the embedding), prompt ⊕ completion within the policy's context (positions beyond it are untrained
    or fail)."""
    for key, (ids, mask) in (("prompt_ids", prompts), ("completion_ids", completions)):
        bad = mask.bool() & ((ids < 0) | (ids >= (vocab_size if vocab_size is not None else ids.max() + 1)))
        if bad.any():
            row = int(bad.any(1).nonzero()[0])
            raise ValueError(
                f"rollout_func's '{key}' row {row} holds ids outside the policy's vocabulary [0, {vocab_size}): "
                f"{ids[row][bad[row]].tolist()[:5]}. Tokenize with the trainer's processing_class (a sampler with "
                "another tokenizer, or a placeholder such as -100, gives such ids)."
            )
    lengths = prompts[1].sum(1) + completions[1].sum(1)
    if context is not None and (lengths > context).any():
        row = int((lengths > context).nonzero()[0])
        raise ValueError(
            f"rollout_func's row {row} has {int(prompts[1][row].sum())} prompt and {int(completions[1][row].sum())} "
            f"completion tokens, more than the policy's context of {context} (max_position_embeddings). Bound the "
            "trajectory in rollout_func (e.g. stop calling tools, or cut tool results) so prompt and completion fit."
        )


def _check_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> None:
    """The sampler's log-probs (B, T) weight the loss (importance sampling): each real one finite and ≤ 0."""
    bad = mask.bool() & (~torch.isfinite(logprobs) | (logprobs > _LOGPROB_ROUNDING))
    if bad.any():
        row, position = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"rollout_func's 'logprobs' row {row} token {position} is {logprobs[row, position].item()}: a "
            "log-probability is finite and ≤ 0, and rollout_func_importance_sampling weights the loss by "
            "exp(π − logprobs). Return the sampler's log-probs of the sampled tokens (0 where a tool wrote), not "
            "logits or placeholders."
        )


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
