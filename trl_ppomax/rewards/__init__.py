"""Reward sources: what scores a response.

A source is a reward model (``*ForSequenceClassification``, one label, read at
:func:`~trl_ppomax.models.score_position`) or a Python function called as TRL's ``GRPOTrainer`` calls its
``reward_funcs`` (:func:`call_reward_function`). :class:`RewardSources` holds a weighted list of them, logged as
``rewards/<name>/mean``; the missing-stop-token penalty applies to the combined score. Reward normalisation starts
from the reward model's stored statistics (:func:`initial_reward_moments`, :mod:`~trl_ppomax.rewards.stats`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import os
import reprlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import nn
from trl import is_conversational
from trl.trainer.utils import disable_dropout_in_model

from trl_ppomax.models import backbone_and_head, check_single_label, sequence_scores
from trl_ppomax.ppo import core
from trl_ppomax.rewards.stats import running_moments_from_config

logger = logging.getLogger(__name__)

RewardFunction = Callable[[list[str], list[str]], Sequence[float]]


# --------------------------------------------------------------------------------------------------------------------
# Reward sources
# --------------------------------------------------------------------------------------------------------------------
def decode_texts(tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Decode the masked tokens of each row, without special tokens."""
    return [tokenizer.decode(row[m.bool()], skip_special_tokens=True) for row, m in zip(ids, mask, strict=True)]


def is_positional_pair(function, available: Sequence[str] = ()) -> bool:
    """Whether ``function`` is an old-style ``f(prompts, completions)``: exactly two positional parameters, no
    ``**kwargs``, and not both named after keywords it would be given (``available``; then keywords work too)."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(parameters) != 2 or any(p.kind not in kinds for p in parameters):
        return False
    return not all(p.name in available and p.kind != inspect.Parameter.POSITIONAL_ONLY for p in parameters)


#: The keywords every reward function is offered (the dataset's other columns come with them).
REWARD_KEYWORDS = ("prompts", "completions", "completion_ids")
#: Dataset columns that are not passed to reward functions (``prompt`` comes as ``prompts=``).
NOT_PASSED_COLUMNS = ("prompt", "input_ids", "attention_mask", "loss_mask")


def reward_function_problem(function, available: Sequence[str], what: str = "reward function") -> str | None:
    """Why ``function`` cannot be called in either of the two ways :func:`call_reward_function` calls it (with the
    keywords ``available``, or as an old-style positional pair), or None when it can (or has no signature to read):
    a parameter without a default that is not among the keywords, e.g. ``f(p, c, **kwargs)`` or ``f(a)``."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None
    if is_positional_pair(function, available):
        return None
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    required = [p for p in parameters if p.default is inspect.Parameter.empty and p.kind not in variadic]
    missing = [p.name for p in required if p.kind == inspect.Parameter.POSITIONAL_ONLY or p.name not in available]
    if not missing:
        return None
    name = getattr(function, "__name__", type(function).__name__)
    columns = [key for key in available if key not in REWARD_KEYWORDS]
    column_text = f" (here: {', '.join(columns)})" if columns else " (none here)"
    shown = ", ".join(str(p) for p in parameters)
    return (
        f"The {what} {name!r}({shown}) cannot be called: its parameter{'s' if len(missing) > 1 else ''} "
        f"{', '.join(missing)} would get no value. A {what} is called in one of two ways: with keywords, as TRL's "
        "GRPOTrainer calls them, f(prompts=..., completions=..., completion_ids=..., **dataset columns"
        f"{column_text}), each parameter named after one of them (or **kwargs for the rest); or, old style, with "
        "exactly two positional parameters, f(prompts, completions), and no **kwargs. Rename its parameters, e.g. "
        "def reward(prompts, completions, **kwargs), or drop the **kwargs of a two-parameter function."
    )


def check_reward_functions(sources, columns: Sequence[str] = (), what: str = "reward function") -> None:
    """A ``TypeError`` (:func:`reward_function_problem`) for a function among ``sources`` (one source or a list; models
    and paths are skipped) that could not be called with the keywords and the dataset ``columns``."""
    available = [*REWARD_KEYWORDS, *(c for c in columns if c not in NOT_PASSED_COLUMNS)]
    for source in sources if isinstance(sources, list | tuple) else [sources]:
        if callable(source) and not isinstance(source, nn.Module):
            problem = reward_function_problem(source, available, what)
            if problem:
                raise TypeError(problem)


def _accepted_keywords(function, keywords: dict) -> dict:
    """``keywords`` restricted to the parameters of ``function`` unless it takes ``**kwargs``."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return keywords
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters):
        return keywords
    names = {p.name for p in parameters}
    return {key: value for key, value in keywords.items() if key in names}


def _names_parameter(function, name: str) -> bool:
    """Whether ``function`` has a parameter ``name`` that can be given by keyword (``**kwargs`` does not count)."""
    try:
        parameter = inspect.signature(function).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)


def call_reward_function(
    function: RewardFunction,
    prompts: list,
    completions: list,
    device: torch.device,
    *,
    completion_ids: list[list[int]] | None = None,
    columns: dict[str, list] | None = None,
    texts: tuple[list[str], list[str]] | None = None,
    sequence_texts: Callable[[], list[str]] | None = None,
) -> torch.Tensor:
    """Scores (B,) of a Python reward ``function``, called as TRL's ``GRPOTrainer`` does:
    ``function(prompts=, completions=, completion_ids=, **columns)`` (only the keywords it accepts, unless it takes
    ``**kwargs``; conversational completions as ``[{"role": "assistant", "content": ...}]``), or, for an old-style
    two-argument function (:func:`is_positional_pair`), ``function(prompts, completions)`` on the decoded ``texts``.
    A function naming a ``sequence_texts`` parameter (:class:`~trl_ppomax.rewards.remote.RemoteRewardModel`) also
    gets those (:func:`completion_texts`), over a dataset column of that name.

    It must return one number (None becomes NaN, as in GRPO; NaN and ±inf pass) per completion as a list, tuple,
    numpy array or 1-D tensor; anything else raises a ``ValueError`` blaming it and showing what it returned."""
    keywords = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **(columns or {})}
    if sequence_texts is not None and _names_parameter(function, "sequence_texts"):
        keywords["sequence_texts"] = sequence_texts()
    problem = reward_function_problem(function, list(keywords))
    if problem:  # before calling it: a TypeError raised inside the function is its own
        raise TypeError(problem)
    if is_positional_pair(function, keywords):
        returned = function(*(texts or (prompts, completions)))
    else:
        returned = function(**_accepted_keywords(function, keywords))
    if inspect.isawaitable(returned):  # an async function: its scores once awaited (see awaited)

        async def scores_when_done():
            return checked_scores(function, await returned, len(prompts), device)

        return scores_when_done()
    return checked_scores(function, returned, len(prompts), device)


def checked_scores(function: RewardFunction, returned, count: int, device: torch.device) -> torch.Tensor:
    """The scores (``count``,) in what reward ``function`` ``returned``, None as NaN; a ``ValueError`` blaming it
    when that is not one number (or None) per completion."""
    if isinstance(returned, torch.Tensor | np.ndarray) and returned.ndim == 1:
        values = returned.tolist()
    elif isinstance(returned, Sequence) and not isinstance(returned, str | bytes):
        values = list(returned)
    else:
        raise _reward_function_fault(function, returned, count, "it did not return a sequence of scores")
    if len(values) != count:
        problem = f"it returned {len(values)} scores for {count} completions"
        raise _reward_function_fault(function, returned, count, problem)
    if values and all(value is None for value in values):
        logger.warning(
            "The reward function %r returned None for all %d completions: None marks a sample it does not score, "
            "so these samples are dropped unless another reward source scores them.",
            source_name(function),
            count,
        )
    values = [math.nan if value is None else value for value in values]
    wrong = [value for value in values if not _is_number(value)]
    if wrong:
        problem = (
            f"it must return numbers, but {len(wrong)} of its {len(values)} scores are not (e.g. "
            f"{type(wrong[0]).__name__} {_SHORT.repr(wrong[0])})"
        )
        raise _reward_function_fault(function, returned, count, problem)
    return torch.tensor([float(value) for value in values], device=device)


def awaited(values: list) -> list:
    """``values`` with every awaitable among them (the scores of ``async def`` reward functions) awaited, all at
    once, as TRL's ``GRPOTrainer`` awaits its async reward functions concurrently: one ``asyncio.gather`` in an event
    loop of its own (in a thread when one already runs here, as in a notebook)."""
    pending = [i for i, value in enumerate(values) if inspect.isawaitable(value)]
    if not pending:
        return values

    async def gather() -> list:
        return await asyncio.gather(*(values[i] for i in pending))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        results = asyncio.run(gather())
    else:
        with ThreadPoolExecutor(max_workers=1) as pool:
            results = pool.submit(asyncio.run, gather()).result()
    done = list(values)
    for i, result in zip(pending, results, strict=True):
        done[i] = result
    return done


_SHORT = reprlib.Repr()  # a short repr of what a reward function returned, for the error message
_SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 6, 6, 4, 60, 80


def _is_number(value) -> bool:
    if isinstance(value, torch.Tensor | np.ndarray):
        return value.size == 1 if isinstance(value, np.ndarray) else value.numel() == 1 and not value.is_complex()
    return isinstance(value, numbers.Real)


def _reward_function_fault(function, returned, count: int, problem: str) -> ValueError:
    name = getattr(function, "__name__", type(function).__name__)
    return ValueError(
        f"The reward function {name!r} is at fault: {problem}. It returned {type(returned).__name__} "
        f"{_SHORT.repr(returned)}; a reward function must return a list, tuple, numpy array or 1-D tensor with one "
        f"number per completion ({count} here)."
    )


def completion_texts(
    tokenizer, rollout_ids: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], columns: dict | None
) -> dict:
    """What a reward source gets for ``(query_ids, query_mask, response_ids, response_mask)``: decoded ``texts``,
    TRL-style ``prompts`` (the ``prompt`` column if any) and ``completions``, ``completion_ids``, other ``columns``,
    and ``sequence_texts``: a function returning each row's prompt ⊕ response ids decoded once, padding removed,
    special tokens kept (an EOS the response ended with too), OpenRLHF's remote reward ``query``; called only for the
    sources that take them (one more decode of every row)."""
    query_ids, query_mask, response_ids, response_mask = rollout_ids
    texts = (decode_texts(tokenizer, query_ids, query_mask), decode_texts(tokenizer, response_ids, response_mask))
    columns = dict(columns or {})
    prompts = columns.pop("prompt", None) or texts[0]
    completions = texts[1]
    if is_conversational({"prompt": prompts[0]}):
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


def score_responses(
    reward: nn.Module | RewardFunction,
    tokenizer,
    inputs: dict[str, torch.Tensor],
    query_mask: torch.Tensor,
    response_mask: torch.Tensor,
    columns: dict[str, list] | None = None,
    reward_tokenizer=None,
) -> torch.Tensor:
    """Scores (B,) of query ⊕ response ``inputs`` (see :func:`~trl_ppomax.models.sequence_inputs`) by a reward model,
    or by a reward function (:func:`call_reward_function`, given the dataset's other ``columns``). A reward model with
    its own ``reward_tokenizer`` scores the texts re-encoded with it (:func:`score_with_own_tokenizer`)."""
    query_width = query_mask.shape[1]
    if isinstance(reward, nn.Module) and reward_tokenizer is None:
        return sequence_scores(reward, inputs)
    ids = inputs["input_ids"]
    given = completion_texts(
        tokenizer, (ids[:, :query_width], query_mask, ids[:, query_width:], response_mask), columns
    )
    if isinstance(reward, nn.Module):
        prompts, completions = given["prompts"], given["texts"][1]
        if is_conversational({"prompt": prompts[0]}):
            sequences = [[*p, {"role": "assistant", "content": c}] for p, c in zip(prompts, completions, strict=True)]
        else:  # the very text the policy saw: decoded whole, so that no word boundary is lost between the two parts
            sequences = decode_texts(tokenizer, ids, inputs["attention_mask"])
        return score_with_own_tokenizer(reward, reward_tokenizer, sequences, ids.device)
    return call_reward_function(reward, given.pop("prompts"), given.pop("completions"), ids.device, **given)


def score_with_own_tokenizer(model: nn.Module, tokenizer, sequences: list, device) -> torch.Tensor:
    """Scores (B,) of a reward model with its own tokenizer (TRL's ``reward_processing_classes``): each prompt ⊕
    completion, a text or a conversation ending with the assistant's answer, encoded with ``tokenizer`` (its chat
    template for a conversation), right-padded."""
    if is_conversational({"prompt": sequences[0]}):
        texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in sequences]
        encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    else:
        encoded = [tokenizer(text)["input_ids"] for text in sequences]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    from trl.trainer.utils import pad

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
    the sources: a tokenizer (or a path) for a reward model with its own vocabulary, None for the policy's."""

    def __init__(self, sources, processing_classes=None, weights=None) -> None:
        self.sources = list(sources) if isinstance(sources, list | tuple) else [sources]
        if not self.sources:
            raise ValueError("No reward source: pass a reward model, a reward function or a list of them.")
        for index, source in enumerate(self.sources):
            if not (isinstance(source, nn.Module) or callable(source)):
                raise TypeError(
                    f"reward source {index} is a {type(source).__name__}: pass a reward model (nn.Module), a path or "
                    "Hub id of one, or a reward function."
                )
        count = len(self.sources)
        processing_classes = list(processing_classes) if processing_classes is not None else [None] * count
        weights = list(weights) if weights is not None else [1.0] * count
        for name, given in (("reward_processing_classes", processing_classes), ("reward_weights", weights)):
            if len(given) != count:
                raise ValueError(f"{name} has {len(given)} entries for {count} reward sources; give one per source.")
        self.processing_classes = [_load_tokenizer(p) for p in processing_classes]
        self.weights = [float(w) for w in weights]
        names = [source_name(source) for source in self.sources]
        self.names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
        for source, tokenizer in zip(self.sources, self.processing_classes, strict=True):
            if isinstance(source, nn.Module):
                disable_dropout_in_model(source)
                check_single_label(source)
                backbone_and_head(source)
            if tokenizer is not None and tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
                raise ValueError("A reward processing class needs a pad or eos token to pad with.")

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
        """The first reward model reading the policy's tokens (the critic's initialisation); if none, a ValueError
        naming the fix when ``value_model`` is None, else the first reward model (or source)."""
        for index, module in self.modules:
            if self.processing_classes[index] is None:
                return module
        if value_model is None:
            reason = (
                "every reward model has its own tokenizer, and the critic reads the policy's tokens"
                if self.modules
                else "the reward is a function"
            )
            raise ValueError(
                f"The critic cannot be initialised from the reward model: {reason}. Pass a value_model (an "
                "AutoModelForSequenceClassification with num_labels=1)."
            )
        return self.modules[0][1] if self.modules else self.sources[0]

    def prepare(self, prepare_module) -> None:
        """Replace each reward model by ``prepare_module(model)`` (frozen, on the device or sharded)."""
        for index, module in self.modules:
            self.sources[index] = prepare_module(module)

    def score(self, tokenizer, inputs, query_mask, response_mask, columns=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(combined (B,), per-source (B, S))`` scores of query ⊕ response ``inputs``."""
        each = [
            score_responses(source, tokenizer, inputs, query_mask, response_mask, columns, reward_tokenizer)
            for source, reward_tokenizer in zip(self.sources, self.processing_classes, strict=True)
        ]
        each = [scores.float() for scores in awaited(each)]  # async reward functions, concurrently
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


def load_reward_function(path: str) -> RewardFunction:
    """The reward function at a dotted path ``pkg.module.fn`` (the recipes' ``--reward_funcs``), as TRL's scripts
    resolve theirs; an ``http://`` or ``https://`` URL is a reward server
    (:class:`~trl_ppomax.rewards.remote.RemoteRewardModel` with its defaults). A module of the current folder is
    found too."""
    if path.startswith(("http://", "https://")):
        from trl_ppomax.rewards.remote import RemoteRewardModel

        return RemoteRewardModel(path)
    module_name, _, attribute = path.rpartition(".")
    if not module_name:
        raise ValueError(f"--reward_funcs {path!r} is not a dotted path: use 'pkg.module.function'.")
    try:
        function = getattr(_import_from_here_too(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--reward_funcs {path!r} could not be imported: {error}") from error
    if not callable(function):
        raise ValueError(f"--reward_funcs {path!r} is a {type(function).__name__}, not a function.")
    return function


def _import_from_here_too(module_name: str):
    """``importlib.import_module``, also finding a module of the current folder (``my_rewards.py`` beside the
    user's config), which an installed command or a script elsewhere does not have on ``sys.path``."""
    import importlib
    import sys

    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        here = os.getcwd()
        if here in sys.path or error.name != module_name.partition(".")[0]:
            raise
        sys.path.append(here)
        return importlib.import_module(module_name)


def _load_tokenizer(value):
    if isinstance(value, str | os.PathLike):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.fspath(value))
    return value


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
