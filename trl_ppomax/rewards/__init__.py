"""Reward sources: what scores a response, behind one protocol, :class:`RewardSource` (``name``, logged as
``rewards/<name>/mean``, and ``score(ScoringBatch) -> (B,)`` scores or an awaitable of them). What a user passes
becomes one (:func:`as_source`): a reward model reading the policy's tokens (:class:`ModelSource`, read at
:func:`~trl_ppomax.models.score_position`) or with its own tokenizer (:class:`OwnTokenizerModelSource`), a Python
function, sync or async, or a remote server (:class:`FunctionSource`, called as TRL's ``GRPOTrainer`` calls its
``reward_funcs``, :mod:`.functions`), or a :class:`RewardSource` of the user's own. :class:`RewardSources` is their
weighted list; the missing-stop-token penalty applies to the combined score. Reward normalisation starts from the
reward model's stored statistics (:func:`initial_reward_moments`, :mod:`~trl_ppomax.rewards.stats`).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn
from transformers import AutoTokenizer
from trl import is_conversational
from trl.trainer.utils import disable_dropout_in_model, pad

from trl_ppomax.base import core
from trl_ppomax.models import backbone_and_head, check_single_label, sequence_scores
from trl_ppomax.rewards.functions import (
    RewardFunction,
    awaited,
    call_reward_function,
    check_reward_functions,
    load_reward_function,
)
from trl_ppomax.rewards.stats import running_moments_from_config

__all__ = [
    "FunctionSource",
    "ModelSource",
    "OwnTokenizerModelSource",
    "RewardFunction",
    "RewardLog",
    "RewardSource",
    "RewardSources",
    "ScoringBatch",
    "as_source",
    "awaited",
    "call_reward_function",
    "check_reward_functions",
    "load_reward_function",
]

logger = logging.getLogger(__name__)


def decode_texts(tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Decode the masked tokens of each row, without special tokens."""
    return [tokenizer.decode(row[m.bool()], skip_special_tokens=True) for row, m in zip(ids, mask, strict=True)]


def completion_texts(
    tokenizer, rollout_ids: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], columns: dict | None
) -> dict:
    """What a reward source gets for ``(query_ids, query_mask, response_ids, response_mask)``: decoded ``texts``,
    TRL-style ``prompts`` (the ``prompt`` column if any) and ``completions`` (an agent's ``completions`` column, the
    trajectories' messages, as TRL gives them; else the decoded responses), ``completion_ids``, other ``columns``,
    and ``sequence_texts``, a function decoding each row's prompt ⊕ response ids once, padding removed, special tokens
    kept (OpenRLHF's remote reward ``query``), called only for the sources that take them."""
    query_ids, query_mask, response_ids, response_mask = rollout_ids
    texts = (decode_texts(tokenizer, query_ids, query_mask), decode_texts(tokenizer, response_ids, response_mask))
    columns = dict(columns or {})
    prompts = columns.pop("prompt", None) or texts[0]
    completions = columns.pop("completions", None) or texts[1]
    if is_conversational({"prompt": prompts[0]}) and isinstance(completions[0], str):
        completions = [[{"role": "assistant", "content": text}] for text in completions]
    ids = [row[m.bool()].tolist() for row, m in zip(response_ids, response_mask, strict=True)]

    def sequence_texts() -> list[str]:
        prompt_ids = [row[m.bool()].tolist() for row, m in zip(query_ids, query_mask, strict=True)]
        return [tokenizer.decode(p + r, skip_special_tokens=False) for p, r in zip(prompt_ids, ids, strict=True)]

    return dict(
        prompts=prompts,
        completions=completions,
        completion_ids=ids,
        columns=columns,
        texts=texts,
        sequence_texts=sequence_texts,
    )


@dataclass
class ScoringBatch:
    """A rollout chunk to score: query ⊕ response ``inputs`` (``input_ids``, ``attention_mask``, ``position_ids``,
    :func:`~trl_ppomax.models.sequence_inputs`), the query and response masks, the policy's ``tokenizer`` and the
    dataset's other ``columns`` of these prompts (lists). ``given`` is what a function gets (:func:`completion_texts`),
    decoded once, on first use; ``run_keywords`` are the run's own keywords a function gets beside them
    (:attr:`RewardSources.run_keywords`)."""

    tokenizer: object
    inputs: dict[str, torch.Tensor]
    query_mask: torch.Tensor
    response_mask: torch.Tensor
    columns: dict[str, list] | None = None
    run_keywords: dict | None = None

    @cached_property
    def given(self) -> dict:
        ids, width = self.inputs["input_ids"], self.query_mask.shape[1]
        rows = (ids[:, :width], self.query_mask, ids[:, width:], self.response_mask)
        return completion_texts(self.tokenizer, rows, self.columns)


class RewardSource:
    """The reward-source protocol: ``name``, and ``score(batch)`` → scores (B,) of a :class:`ScoringBatch` (float;
    NaN for a sample it does not score), or an awaitable of them (awaited with the other sources', concurrently). A
    source of one's own subclasses it and can be passed wherever a reward model or function can."""

    name: str = "reward"

    def score(self, batch: ScoringBatch):
        raise NotImplementedError


class ModelSource(RewardSource):
    """A reward model reading the policy's token ids: its score head at the last real token."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.name = model, source_name(model)

    def score(self, batch: ScoringBatch) -> torch.Tensor:
        return sequence_scores(self.model, batch.inputs)


class OwnTokenizerModelSource(ModelSource):
    """A reward model with a vocabulary of its own (TRL's ``reward_processing_classes``), scored by
    :func:`score_with_own_tokenizer` on a conversation ending with the assistant's answer, or on the very text the
    policy saw, decoded whole so that no word boundary is lost between prompt and response."""

    def __init__(self, model: nn.Module, tokenizer) -> None:
        super().__init__(model)
        self.tokenizer = tokenizer

    def score(self, batch: ScoringBatch) -> torch.Tensor:
        prompts, completions = batch.given["prompts"], batch.given["texts"][1]
        if is_conversational({"prompt": prompts[0]}):
            sequences = [[*p, {"role": "assistant", "content": c}] for p, c in zip(prompts, completions, strict=True)]
        else:
            sequences = decode_texts(batch.tokenizer, batch.inputs["input_ids"], batch.inputs["attention_mask"])
        return score_with_own_tokenizer(self.model, self.tokenizer, sequences, batch.inputs["input_ids"].device)


class FunctionSource(RewardSource):
    """A Python reward function, sync or ``async def``, or a remote server
    (:class:`~trl_ppomax.rewards.remote.RemoteRewardModel`), called by :func:`call_reward_function`."""

    def __init__(self, function: RewardFunction) -> None:
        self.function, self.name = function, source_name(function)

    def score(self, batch: ScoringBatch):
        given = dict(batch.given)
        given["columns"] = {**given["columns"], **(batch.run_keywords or {})}
        device = batch.inputs["input_ids"].device
        return call_reward_function(self.function, given.pop("prompts"), given.pop("completions"), device, **given)


def as_source(source, tokenizer=None) -> RewardSource:
    """The :class:`RewardSource` of what a user passed: a :class:`RewardSource` as it is, a reward model (with its own
    ``tokenizer``, or None for the policy's), or a reward function."""
    if isinstance(source, RewardSource):
        return source
    if isinstance(source, nn.Module):
        return ModelSource(source) if tokenizer is None else OwnTokenizerModelSource(source, tokenizer)
    return FunctionSource(source)


def score_with_own_tokenizer(model: nn.Module, tokenizer, sequences: list, device) -> torch.Tensor:
    """Scores (B,) of a reward model on ``sequences`` (texts, or conversations ending with the assistant's answer)
    encoded with its own ``tokenizer`` (its chat template for a conversation), right-padded."""
    if is_conversational({"prompt": sequences[0]}):
        texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in sequences]
        encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    else:
        encoded = [tokenizer(text)["input_ids"] for text in sequences]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = [torch.as_tensor(ids or [pad_id], dtype=torch.long) for ids in encoded]
    input_ids = pad(rows, padding_value=pad_id or 0, padding_side="right").to(device)
    attention_mask = pad([torch.ones_like(r) for r in rows], padding_value=0, padding_side="right").to(device)
    return sequence_scores(model, {"input_ids": input_ids, "attention_mask": attention_mask})


def source_name(source) -> str:
    """A source's name in ``rewards/<name>/mean``: ``__name__``, a model's ``_name_or_path`` basename, or class."""
    if isinstance(source, nn.Module):
        path = getattr(getattr(source, "config", None), "_name_or_path", "") or ""
        return os.path.basename(os.path.normpath(path)) if path else type(source).__name__
    return getattr(source, "__name__", None) or type(source).__name__


class RewardSources:
    """The trainer's reward sources (TRL's ``reward_funcs``): reward models, functions and model ids (loaded by the
    trainer's checks first), combined as ``Σ wᵢ·rᵢ`` with ``weights`` (all 1 by default; NaN scores of a source, e.g.
    a function returning None, are left out of the sum unless every source is NaN). ``processing_classes`` aligns with
    the sources: a tokenizer (or a path) for a reward model with its own vocabulary, None for the policy's.
    ``run_keywords``: what every reward function gets beside the batch (the trainer sets TRL's ``trainer_state`` and
    ``log_metric``, :class:`RewardLog`)."""

    def __init__(self, sources, processing_classes=None, weights=None) -> None:
        self.sources = list(sources) if isinstance(sources, list | tuple) else [sources]
        if not self.sources:
            raise ValueError("No reward source: pass a reward model, a reward function or a list of them.")
        for index, source in enumerate(self.sources):
            if not (isinstance(source, nn.Module | RewardSource) or callable(source)):
                raise TypeError(
                    f"reward source {index} is a {type(source).__name__}: pass a reward model (nn.Module), a path or "
                    "Hub id of one, a reward function, or a RewardSource."
                )
        count = len(self.sources)
        if processing_classes is None:
            processing_classes = [None] * count
        elif not isinstance(processing_classes, list | tuple):  # one tokenizer, as TRL takes it for one source
            processing_classes = [processing_classes]
        processing_classes = list(processing_classes)
        weights = list(weights) if weights is not None else [1.0] * count
        for name, given in (("reward_processing_classes", processing_classes), ("reward_weights", weights)):
            if len(given) != count:
                raise ValueError(
                    f"{name} has {len(given)} entries for {count} reward sources: the number must match; give one "
                    "per source."
                )
        self.processing_classes = [
            AutoTokenizer.from_pretrained(os.fspath(p)) if isinstance(p, str | os.PathLike) else p
            for p in processing_classes
        ]
        self.weights = [float(w) for w in weights]
        self.run_keywords: dict = {}
        names = [scorer.name for scorer in self.scorers]
        self.names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
        for source, tokenizer in zip(self.sources, self.processing_classes, strict=True):
            if isinstance(source, nn.Module):
                disable_dropout_in_model(source)
                check_single_label(source)
                backbone_and_head(source)
            if tokenizer is not None and tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
                raise ValueError("A reward processing class needs a pad or eos token to pad with.")

    @property
    def scorers(self) -> list[RewardSource]:
        """Each source behind the :class:`RewardSource` protocol (the prepared models once :meth:`prepare` ran)."""
        return [as_source(s, t) for s, t in zip(self.sources, self.processing_classes, strict=True)]

    @property
    def modules(self) -> list[tuple[int, nn.Module]]:
        return [(i, s) for i, s in enumerate(self.sources) if isinstance(s, nn.Module)]

    def shared_vocabulary_models(self) -> dict[str, nn.Module]:
        """The reward models reading the policy's token ids, by argument name, for the vocabulary checks."""
        shared = [(i, m) for i, m in self.modules if self.processing_classes[i] is None]
        if len(self.sources) == 1:
            return {"reward_model": shared[0][1]} if shared else {}
        return {f"reward_model[{i}]": m for i, m in shared}

    def critic_source(self, value_model=None):
        """The first reward model reading the policy's tokens (the critic's initialisation, §5.3.3); else, with a
        ``value_model``, the first reward model (or source), and without one None: the critic is then built from the
        policy with a fresh scalar head (:func:`~trl_ppomax.models.critic_from_policy`)."""
        for index, module in self.modules:
            if self.processing_classes[index] is None:
                return module
        if value_model is None:
            return None
        return self.modules[0][1] if self.modules else self.sources[0]

    def prepare(self, prepare_module) -> None:
        """Replace each reward model by ``prepare_module(model)`` (frozen, on the device or sharded)."""
        for index, module in self.modules:
            self.sources[index] = prepare_module(module)

    def score(self, tokenizer, inputs, query_mask, response_mask, columns=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(combined (B,), per-source (B, S))`` scores of query ⊕ response ``inputs``."""
        batch = ScoringBatch(tokenizer, inputs, query_mask, response_mask, columns, self.run_keywords)
        each = [scores.float() for scores in awaited([scorer.score(batch) for scorer in self.scorers])]
        per_source = torch.stack(each, dim=1)
        if len(each) == 1:
            return per_source[:, 0] * self.weights[0], per_source
        weights = torch.tensor(self.weights, device=per_source.device)
        combined = (per_source * weights).nansum(dim=1)
        combined[per_source.isnan().all(dim=1)] = math.nan
        return combined, per_source

    def metrics(self, per_source: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """``{rewards/<name>/mean: scores (B,)}`` of each source (averaged by the trainer's metric code)."""
        if per_source is None:
            return {}
        return {f"rewards/{name}/mean": per_source[:, i] for i, name in enumerate(self.names)}


class RewardLog:
    """TRL's ``log_metric(name, value)`` for reward functions: each value kept until :meth:`pop_metrics` returns
    their means (the trainer logs them with the iteration's metrics)."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}

    def log_metric(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(float(value))

    def pop_metrics(self) -> dict[str, float]:
        means = {name: sum(values) / len(values) for name, values in self.values.items()}
        self.values = {}
        return means


def text_metrics(functions: dict[str, RewardFunction], tokenizer, rollout) -> dict[str, torch.Tensor]:
    """``{name: f(prompts, completions)}`` (B,) each on a rollout's decoded prompts and responses (the trainer's
    ``rollout_metrics``; keyword-style functions get ``completion_ids`` too)."""
    if not functions:
        return {}
    ids = (rollout.query_ids, rollout.query_mask, rollout.response_ids, rollout.response_mask)
    given = completion_texts(tokenizer, ids, None)
    prompts, completions, device = given["prompts"], given["completions"], rollout.scores.device
    keywords = {"completion_ids": given["completion_ids"], "texts": given["texts"]}
    scores = awaited([call_reward_function(f, prompts, completions, device, **keywords) for f in functions.values()])
    return dict(zip(functions, scores, strict=True))


def apply_missing_eos_penalty(
    scores: torch.Tensor, responses: torch.Tensor, mask: torch.Tensor, stop_token_id: int, penalty: float | None
) -> torch.Tensor:
    """``scores − penalty`` for the responses (B,) without the stop token; unchanged when ``penalty`` is None."""
    if penalty is None:
        return scores
    return scores - penalty * (1.0 - core.ends_with_stop(responses, mask, stop_token_id))


def initial_reward_moments(sources: RewardSources, reward_norm: str) -> core.RunningMoments:
    """The starting running reward moments when rewards are normalised: the statistics stored in the config of the
    one reward model, times its weight w (``w·r`` has mean ``w·μ``, std ``|w|·σ``); empty with several sources or no
    stored statistics. Stored statistics are checked in every case."""
    seeds = [running_moments_from_config(getattr(module, "config", None)) for _, module in sources.modules]
    if reward_norm == "none" or len(sources.sources) != 1 or seeds[:1] in ([], [None]):
        if reward_norm != "none" and any(seeds) and len(sources.sources) != 1:
            logger.info(
                "Several reward sources: reward normalisation starts empty (their sum has no stored statistics)."
            )
        return core.RunningMoments()
    seeded, weight = seeds[0], sources.weights[0]
    state = seeded.state_dict()
    seeded.load_state_dict({**state, "mean": state["mean"] * weight, "m2": state["m2"] * weight**2})
    logger.info(
        "Reward normalisation starts from the reward model's stored statistics (× weight %s): %s", weight, seeded
    )
    return seeded
