"""Reward functions, called as TRL's ``GRPOTrainer`` calls its ``reward_funcs`` (:func:`call_reward_function`): sync
or ``async def`` (:func:`awaited`), one number or None per completion, their faults named before or as they are called
(:func:`reward_function_problem`, :func:`checked_scores`); :func:`load_reward_function` reads ``--reward_funcs``.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import numbers
import os
import reprlib
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import nn

from trl_ppomax.rewards.remote import RemoteRewardModel

logger = logging.getLogger(__name__)

RewardFunction = Callable[[list[str], list[str]], Sequence[float]]


def _parameters(function) -> list[inspect.Parameter] | None:
    """The parameters of ``function``, or None when it has no signature to read."""
    try:
        return list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None


def is_positional_pair(function, available: Sequence[str] = ()) -> bool:
    """Whether ``function`` is an old-style ``f(prompts, completions)``: exactly two positional parameters, no
    ``**kwargs``, and not both named after keywords it would be given (``available``; then keywords work too)."""
    parameters = _parameters(function)
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if parameters is None or len(parameters) != 2 or any(p.kind not in kinds for p in parameters):
        return False
    return not all(p.name in available and p.kind != inspect.Parameter.POSITIONAL_ONLY for p in parameters)


#: The keywords every reward function is offered (the dataset's other columns come with them).
REWARD_KEYWORDS = ("prompts", "completions", "completion_ids")
#: The run's keywords every reward function is offered in training, as TRL's (:class:`~trl_ppomax.rewards.RewardLog`).
RUN_KEYWORDS = ("trainer_state", "log_metric")
#: Dataset columns that are not passed to reward functions (``prompt`` comes as ``prompts=``).
NOT_PASSED_COLUMNS = ("prompt", "input_ids", "attention_mask", "loss_mask")


def reward_function_problem(function, available: Sequence[str], what: str = "reward function") -> str | None:
    """Why ``function`` cannot be called in either of the two ways :func:`call_reward_function` calls it (with the
    keywords ``available``, or as an old-style positional pair), or None when it can (or has no signature to read):
    a parameter without a default that is not among the keywords, e.g. ``f(p, c, **kwargs)`` or ``f(a)``."""
    parameters = _parameters(function)
    if parameters is None or is_positional_pair(function, available):
        return None
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    required = [p for p in parameters if p.default is inspect.Parameter.empty and p.kind not in variadic]
    missing = [p.name for p in required if p.kind == inspect.Parameter.POSITIONAL_ONLY or p.name not in available]
    if not missing:
        return None
    name = getattr(function, "__name__", type(function).__name__)
    columns = [key for key in available if key not in (*REWARD_KEYWORDS, *RUN_KEYWORDS)]
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
    available = [*REWARD_KEYWORDS, *RUN_KEYWORDS, *(c for c in columns if c not in NOT_PASSED_COLUMNS)]
    for source in sources if isinstance(sources, list | tuple) else [sources]:
        if callable(source) and not isinstance(source, nn.Module):
            problem = reward_function_problem(source, available, what)
            if problem:
                raise TypeError(problem)


def _accepted_keywords(function, keywords: dict) -> dict:
    """``keywords`` restricted to the parameters of ``function`` unless it takes ``**kwargs``."""
    parameters = _parameters(function)
    if parameters is None or any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters):
        return keywords
    names = {p.name for p in parameters}
    return {key: value for key, value in keywords.items() if key in names}


def _names_parameter(function, name: str) -> bool:
    """Whether ``function`` has a parameter ``name`` that can be given by keyword (``**kwargs`` does not count)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return any(p.name == name and p.kind in kinds for p in _parameters(function) or ())


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
    A function naming a ``sequence_texts`` parameter (:class:`~trl_ppomax.rewards.remote.RemoteRewardModel`) gets
    those too, over a dataset column of that name. What it returns is checked by :func:`checked_scores`."""
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
    """The scores (``count``,) in what reward ``function`` ``returned``, None as NaN (as in GRPO; NaN and ±inf pass);
    a ``ValueError`` blaming it, showing what it returned, unless that is one number (or None) per completion as a
    list, tuple, numpy array or 1-D tensor."""
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
            getattr(function, "__name__", type(function).__name__),
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
    pending = [value for value in values if inspect.isawaitable(value)]
    if not pending:
        return values

    async def gather() -> list:
        return await asyncio.gather(*pending)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        results = asyncio.run(gather())
    else:
        with ThreadPoolExecutor(max_workers=1) as pool:
            results = pool.submit(asyncio.run, gather()).result()
    results = iter(results)
    return [next(results) if inspect.isawaitable(value) else value for value in values]


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


def load_reward_function(path: str) -> RewardFunction:
    """The reward function at a dotted path ``pkg.module.fn`` (``--reward_funcs``; a module of the current folder is
    found too), as TRL's scripts resolve theirs; an ``http(s)://`` URL is a reward server
    (:class:`~trl_ppomax.rewards.remote.RemoteRewardModel` with its defaults)."""
    if path.startswith(("http://", "https://")):
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
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        here = os.getcwd()
        if here in sys.path or error.name != module_name.partition(".")[0]:
            raise
        sys.path.append(here)
        return importlib.import_module(module_name)
