"""Agent rollouts: the policy calls tools (``tools=[…]``) or acts in an environment (``environment_factory=…``) over
several turns, as TRL ``GRPOTrainer``'s. Each trajectory is::

    prompt (with the tools' schemas) → policy turn → [tool messages → policy turn] × ≤ max_tool_turns

A turn ends at the stop token (the template's end of turn). A turn with tool calls, ended by the stop token, gets the
calls' results as tool messages (:mod:`~trl_ppomax.generation.tools`), then the policy writes again; a turn without a
call, cut by a budget, or past ``max_tool_turns`` ends the trajectory. ``env_mask`` marks the policy's tokens (1) and the
inserted ones (0): the environment's tokens are attended to, never trained on. Budgets: ``response_length`` bounds
the policy's tokens over all turns, ``max_completion_tokens`` (None: no bound) the whole trajectory, tool tokens
included, and the policy's context (``max_position_embeddings``) prompt and trajectory together (a result that does
not fit is cut and ends the trajectory).

``environment_factory()`` makes one instance per trajectory (pooled and reset, as TRL): ``reset(**row)`` gets the
dataset row and may return a string appended to the last user message (a plain method: ``async def reset`` is refused);
its public methods are the trajectory's tools (besides ``tools``; one name, one tool); its ``get_reward()``, if any,
scores the trajectory (:class:`EnvironmentReward`): a number, or None for a trajectory it does not score."""

from __future__ import annotations

import inspect
import itertools
import logging
import numbers
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
from trl import is_conversational

from trl_ppomax import data
from trl_ppomax.base import metrics as M
from trl_ppomax.generation import Generated
from trl_ppomax.generation.rollout_func import padded
from trl_ppomax.generation.tools import ToolRunner, ToolTurnTokens, tool_call_parser, tool_schema
from trl_ppomax.rewards import RewardSource

__all__ = ["AgentRollouts", "EnvironmentReward", "environment_methods"]

_NOT_TOOLS = ("reset", "get_reward")
logger = logging.getLogger(__name__)


def environment_methods(environment) -> dict[str, Callable]:
    """An environment's tools: its public methods (the class's functions, so properties are not evaluated), less
    ``reset`` and ``get_reward``."""
    names = [name for name, _ in inspect.getmembers(type(environment), inspect.isfunction)]
    return {name: getattr(environment, name) for name in names if not name.startswith("_") and name not in _NOT_TOOLS}


class EnvironmentReward(RewardSource):
    """The reward an environment owns: ``get_reward()`` of each trajectory's instance (the ``environments`` column),
    NaN for a trajectory whose environment is of another class; logged as ``rewards/<class name>/mean``."""

    def __init__(self, environment_type: type) -> None:
        self.environment_type, self.name = environment_type, environment_type.__name__

    def score(self, batch):
        environments = (batch.columns or {}).get("environments")
        if environments is None:  # e.g. a sample table scored without the agent loop
            return torch.full((len(batch.query_mask),), float("nan"))
        rewards = self(environments)
        if inspect.isawaitable(rewards):

            async def scores():
                return torch.tensor([float("nan") if r is None else r for r in await rewards])

            return scores()
        return torch.tensor([float("nan") if r is None else r for r in rewards])

    def __call__(self, environments: list, **kwargs):
        """TRL's environment reward function: ``get_reward()`` of each environment of this class, None for the others
        (an awaitable of the list when ``get_reward`` is ``async def``)."""
        mine = [e if type(e) is self.environment_type else None for e in environments]
        if inspect.iscoroutinefunction(self.environment_type.get_reward):

            async def rewards():
                return [None if e is None else self.reward_value(await e.get_reward()) for e in mine]

            return rewards()
        return [None if e is None else self.reward_value(e.get_reward()) for e in mine]

    def reward_value(self, value) -> float | None:
        """``get_reward()``'s value as a float: a number (bool, int, float, numpy scalar, one-element tensor), or None
        (not scored: NaN, dropped unless another source scores it, as a reward function's None)."""
        if value is None:
            return None
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return float(value)
        if isinstance(value, numbers.Real):
            return float(value)
        raise TypeError(
            f"{self.name}.get_reward() returned {value!r} ({type(value).__name__}): it must return a number (or None "
            "for a trajectory it does not score). Convert it, e.g. float(...) of a parsed answer."
        )


class AgentRollouts:
    """The multi-turn loop for one trainer (see the module docstring). ``tools``: the functions every trajectory may
    call; ``environment_factory``: a zero-argument callable making an environment (checked here: it needs ``reset``),
    or TRL's dict of them by name, each row's ``environment`` column choosing its own (only that environment's
    methods are its tools). :meth:`generate` returns a :class:`~trl_ppomax.base.rollout.Generated` of trajectories, with
    TRL's ``completions`` (the messages of each trajectory) for conversational prompts, and the tool statistics
    (``pop_metrics``)."""

    def __init__(
        self, args, tokenizer, tools, environment_factory, stop_token_id: int, *, context_length: int | None = None
    ) -> None:
        self.args, self.tokenizer, self.stop_token_id = args, tokenizer, stop_token_id
        self.context_length = context_length
        self.named = isinstance(environment_factory, dict)
        self.factories = (
            dict(environment_factory)
            if self.named
            else {}
            if environment_factory is None
            else {None: environment_factory}
        )
        self.tools = _by_name(tools or [], "tools")
        self.pools: dict = {name: [self._new_environment(name)] for name in self.factories}
        self.environments: list | None = None
        self.schemas = {None: [tool_schema(function) for function in self.tools.values()]}
        for name, (probe,) in self.pools.items():
            methods = environment_methods(probe)
            _by_name([*self.tools.values(), *methods.values()], f"tools and {type(probe).__name__}'s methods")
            self.schemas[name] = [*self.schemas[None], *(tool_schema(method) for method in methods.values())]
        self.kwargs = dict(getattr(args, "chat_template_kwargs", None) or {})
        if any(self.schemas.values()):
            _warn_if_the_template_hides_tools(tokenizer, [s for schemas in self.schemas.values() for s in schemas])
            self.turn_tokens = ToolTurnTokens(tokenizer, stop_token_id, self.kwargs)
        self.parse = tool_call_parser(tokenizer)
        self.runner, self.stats = ToolRunner(timeout=getattr(args, "tool_timeout", None)), defaultdict(list)

    def close(self) -> None:
        """Stop the tool runner's threads (the trainer calls it when training ends)."""
        self.runner.close()

    @property
    def tool_functions(self) -> list[Callable]:
        """TRL's ``trainer.tools``: the standalone tools, then each environment's methods (of its first instance)."""
        methods = [m for pool in self.pools.values() for m in environment_methods(pool[0]).values()]
        return [*self.tools.values(), *methods]

    @property
    def environment_types(self) -> list[type]:
        """The classes of the environments, once each, in the order of their names."""
        return list(dict.fromkeys(type(pool[0]) for pool in self.pools.values()))

    def _new_environment(self, name):
        environment = self.factories[name]()
        if not callable(getattr(environment, "reset", None)):
            raise ValueError(
                f"environment_factory made a {type(environment).__name__} without a reset() method: an environment "
                "needs reset(**row) -> str | None, called before each trajectory (TRL's contract)."
            )
        if inspect.iscoroutinefunction(environment.reset):
            raise TypeError(
                f"{type(environment).__name__}.reset is async def: reset(**row) runs before the trajectory's first "
                "turn and must return the observation (str | None) itself. Make reset a plain def (run any coroutine "
                "inside it with asyncio.run, or do the async work in a tool)."
            )
        return environment

    def generate(self, engine, prompts: Sequence, rows: dict[str, list], sampling: bool, n: int, pad_id: int, device):
        """``n`` trajectories per prompt (row ``i·n + j``: prompt ``i``'s ``j``-th), ``prompts`` the batch's ``prompt``
        column (conversations get the tools' schemas through the chat template) and ``rows`` its other columns."""
        rows = data.repeat_rows({**rows, "prompt": list(prompts)}, n)
        names = self._environment_names(rows)
        environments = self._environments(names)
        self.environments = environments if self.factories else None  # TRL's trainer.environments: the last batch's
        prompts = [self._prompt(i, rows, environments) for i in range(len(rows["prompt"]))]
        schemas = [self.schemas[name] for name in names]
        prompt_ids = [
            data.tokenize_prompt(p, self.tokenizer, s, self.kwargs) for p, s in zip(prompts, schemas, strict=True)
        ]
        toolboxes = [{**self.tools, **(environment_methods(e) if e is not None else {})} for e in environments]
        trajectories = _Trajectories(prompt_ids)
        self._turns(engine, trajectories, toolboxes, schemas, sampling, device)
        query_ids, query_mask = padded(prompt_ids, pad_id, "left")
        response_ids, response_mask = padded(trajectories.ids, pad_id, "right")
        env_mask = padded(trajectories.env_mask, 0, "right")[0]
        sampler = None
        if trajectories.has_sampler_logprobs:
            sampler = torch.zeros(response_ids.shape)
            for i, row in enumerate(trajectories.logprobs):
                sampler[i, : len(row)] = torch.tensor(row)
        columns = {"environments": environments} if self.factories else {}
        if is_conversational({"prompt": prompts[0]}):  # TRL's completions: the trajectory's messages
            columns["completions"] = trajectories.messages
        self._record(trajectories)
        tensors = (query_ids, query_mask, response_ids, response_mask, sampler, env_mask)
        return Generated(*(None if t is None else t.to(device) for t in tensors), columns)

    def _environment_names(self, rows: dict[str, list]) -> list:
        """Each row's environment: its ``environment`` column's name with a dict of factories, else the one (None)."""
        count = len(rows["prompt"])
        if not self.named:
            return [None] * count
        names = rows.get("environment")
        if names is None:
            raise ValueError(
                f"environment_factory is a dict of environments ({list(self.factories)}): each row must name its own "
                "in an 'environment' column (TRL's contract); the dataset has none."
            )
        unknown = sorted({name for name in names if name not in self.factories}, key=str)
        if unknown:
            raise ValueError(
                f"Rows name the environment {unknown[0]!r}, which is not among the environments passed to "
                f"environment_factory: {list(self.factories)}."
            )
        return list(names)

    def _environments(self, names: list) -> list:
        """One pooled instance per row (more made as a batch needs them), or None without environments."""
        if not self.factories:
            return [None] * len(names)
        handed: dict = defaultdict(int)
        environments = []
        for name in names:
            pool = self.pools[name]
            if handed[name] == len(pool):
                pool.append(self._new_environment(name))
            environments.append(pool[handed[name]])
            handed[name] += 1
        return environments

    def _prompt(self, i: int, rows: dict[str, list], environments: list):
        """Prompt ``i`` after its environment's ``reset(**row)`` (a returned string is appended to the last user
        message, or to a text prompt; the ``environment`` column, a dict's routing key, is not passed)."""
        prompt, environment = rows["prompt"][i], environments[i]
        if environment is None:
            return prompt
        row = {key: values[i] for key, values in rows.items() if not (self.named and key == "environment")}
        observation = environment.reset(**row)
        if not observation:
            return prompt
        if isinstance(prompt, str):
            return prompt + observation
        return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + observation}]

    def _turns(self, engine, trajectories: _Trajectories, toolboxes: list[dict], schemas, sampling: bool, device):
        """Policy turns and tool results until every trajectory ended."""
        active = list(range(len(toolboxes)))
        for turn in itertools.count():
            budgets = {i: self._budget(trajectories, i) for i in active}
            active = [i for i in active if budgets[i] > 0]
            if not active:
                return
            contexts = [trajectories.context(i) for i in active]
            query_ids, query_mask = (t.to(device) for t in padded(contexts, self.tokenizer.pad_token_id, "left"))
            ids, mask, logprobs = engine.generate(query_ids, query_mask, sampling, 1, max(budgets.values()))
            calling = []
            for k, i in enumerate(active):
                length = min(int(mask[k].sum()), budgets[i])
                written = ids[k, :length].tolist()
                trajectories.add(i, written, 1, None if logprobs is None else logprobs[k, :length].tolist())
                message, calls = self.parse(written, contexts[k], schemas[i])
                trajectories.messages[i].append(message)
                calls = calls if schemas[i] else []  # no tool to call (an environment without methods): one turn
                if self.args.malformed_tool_calls == "ignore":  # TRL's: a call that cannot be parsed is text
                    calls = [call for call in calls if call.error is None]
                if not written or written[-1] != self.stop_token_id:
                    continue  # cut by a budget: the trajectory ends
                if calls and (self.args.max_tool_turns is None or turn < self.args.max_tool_turns):
                    calling.append((i, calls))  # counted as TRL counts them: the calls that run
                    trajectories.calls[i] += len(calls)
                    trajectories.malformed[i] += sum(call.error is not None for call in calls)
            active = [i for i, _ in calling]
            self._tool_results(trajectories, toolboxes, calling)

    def _budget(self, trajectories: _Trajectories, i: int) -> int:
        """The most tokens trajectory ``i``'s next policy turn may write: what is left of ``response_length`` and of
        ``max_completion_tokens``."""
        left = self.args.response_length - trajectories.policy_tokens(i)
        room = self._room(trajectories, i)
        return 0 if trajectories.ended[i] else left if room is None else min(left, room)

    def _room(self, trajectories: _Trajectories, i: int) -> int | None:
        """Tokens trajectory ``i`` may still grow by, the policy's and the tools' together: what is left of
        ``max_completion_tokens`` and of the policy's context (prompt included); None: no bound."""
        bounds = []
        if self.args.max_completion_tokens is not None:
            bounds.append(self.args.max_completion_tokens - len(trajectories.ids[i]))
        if self.context_length is not None:
            bounds.append(self.context_length - len(trajectories.context(i)))
        return min(bounds) if bounds else None

    def _tool_results(self, trajectories: _Trajectories, toolboxes: list[dict], calling: list) -> None:
        """Run the calls of this turn and insert their results (cut to ``max_completion_tokens`` and the context,
        ending the trajectory if cut)."""
        results = self.runner.run([(toolboxes[i], calls) for i, calls in calling])
        for (i, _), outcomes in zip(calling, results, strict=True):
            trajectories.failures[i] += sum(failed for _, failed in outcomes)
            messages = [message for message, _ in outcomes]
            trajectories.messages[i] += messages
            tokens = self.turn_tokens(messages)
            room = self._room(trajectories, i)
            if room is not None and len(tokens) >= room:
                tokens = tokens[: max(0, room)]
                trajectories.ended[i] = True
            trajectories.add(i, tokens, 0, [0.0] * len(tokens))
            trajectories.tool_turns[i] += 1

    def _record(self, trajectories: _Trajectories) -> None:
        """TRL's ``tools/call_frequency`` (well-formed calls per trajectory) and ``tools/failure_frequency`` (the share
        of them that failed, 0 without calls), our ``tools/failure_rate`` (malformed calls included) and turns."""
        calls, failures, malformed = (sum(counts) for counts in (trajectories.calls, trajectories.failures,
                                                                  trajectories.malformed))  # fmt: skip
        count, well_formed = len(trajectories.ids), calls - malformed
        self.stats[M.TOOL_CALL_FREQUENCY].append(well_formed / count)
        self.stats[M.TOOL_FAILURE_FREQUENCY].append((failures - malformed) / well_formed if well_formed else 0.0)
        self.stats[M.TOOL_TURNS].append(sum(trajectories.tool_turns) / count)
        if calls:
            self.stats[M.TOOL_FAILURE_RATE].append(failures / calls)

    def pop_metrics(self) -> dict[str, float]:
        """The tool statistics since the last call, averaged over batches."""
        stats, self.stats = self.stats, defaultdict(list)
        return {name: sum(values) / len(values) for name, values in stats.items() if values}


def _by_name(functions: list[Callable], what: str) -> dict[str, Callable]:
    """``functions`` by ``__name__``; two with one name are refused (the model could call only one of them)."""
    named: dict[str, Callable] = {}
    for function in functions:
        name = getattr(function, "__name__", repr(function))
        if name in named:
            raise ValueError(
                f"Two tools are named {name!r} in the {what}: the model calls a tool by name, so only one could ever "
                "run. Rename one (def another_name(...)) or drop it."
            )
        named[name] = function
    return named


def _warn_if_the_template_hides_tools(tokenizer, schemas: list[dict]) -> None:
    """A chat template without a tools block renders ``tools=`` as nothing, and the model never learns its tools."""
    try:
        shown = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tools=schemas, tokenize=False)
    except Exception:  # no chat template: refused later with its own message
        return
    names = [schema["function"]["name"] for schema in schemas]
    if not any(name in shown for name in names):
        logger.warning(
            "The chat template renders none of the tools %s: the prompts will not show them to the model. Use a "
            "template with a tools block (Qwen's, Llama 3's; tokenizer.chat_template = …), or describe the tools in "
            "the prompts yourself.",
            names,
        )


class _Trajectories:
    """The growing completions of a batch: token ids, env_mask, sampler log-probs (0 on inserted tokens), counters."""

    def __init__(self, prompt_ids: list[list[int]]) -> None:
        count = len(prompt_ids)
        self.prompt_ids, self.ids, self.env_mask = prompt_ids, [[] for _ in range(count)], [[] for _ in range(count)]
        self.logprobs: list[list[float]] = [[] for _ in range(count)]
        self.messages: list[list[dict]] = [[] for _ in range(count)]  # TRL's completions: assistant and tool turns
        self.malformed = [0] * count
        self.has_sampler_logprobs = True
        self.ended, self.calls, self.failures, self.tool_turns = [False] * count, [0] * count, [0] * count, [0] * count

    def add(self, i: int, tokens: list[int], env: int, logprobs: list[float] | None) -> None:
        self.ids[i] += tokens
        self.env_mask[i] += [env] * len(tokens)
        if logprobs is None:
            self.has_sampler_logprobs = False
        else:
            self.logprobs[i] += logprobs

    def context(self, i: int) -> list[int]:
        return self.prompt_ids[i] + self.ids[i]

    def policy_tokens(self, i: int) -> int:
        return sum(self.env_mask[i])
