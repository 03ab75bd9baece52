"""Tool calling for agent rollouts, as TRL ``GRPOTrainer``'s ``tools=`` (transformers' tool-use chat format): tools are
Python functions, sync or ``async def``, with type hints and a Google-style docstring, described to the model by their
JSON schema (``transformers.utils.get_json_schema``) through the chat template's ``tools=``. A call is parsed from the
policy's turn by the tokenizer's ``response_template`` (``tokenizer.parse_response``; trl's ``add_response_schema``
sets one for the chat templates it knows: Qwen, Llama 3, GLM, gpt-oss, …), else from Hermes-style
``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` blocks. Results come back as ``{"role": "tool"}`` messages,
whose tokens (:class:`ToolTurnTokens`) the environment inserts after the policy's stop token.

A tool that raises (any exception, ``SystemExit`` from an argparse inside it included; only ``KeyboardInterrupt``
stops the run), runs past ``timeout``, a call to an unknown tool, bad arguments or a malformed call is a **failure**:
its error is the tool message the policy reads, and it is counted (``tools/failure_rate``), never raised."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transformers.utils import get_json_schema

__all__ = [
    "ToolCall",
    "ToolRunner",
    "ToolTurnTokens",
    "end_of_turn_token",
    "parse_tool_calls",
    "tool_call_parser",
    "tool_schema",
]

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_SENTINEL = "\u2063TRL_PPOMAX_TURN\u2063"  # an assistant turn's content when rendering the environment's tokens


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``name`` and ``arguments`` (a dict), or ``error`` (a malformed call: why)."""

    name: str = ""
    arguments: dict | None = None
    error: str | None = None


def tool_schema(function: Callable) -> dict:
    """The tool's JSON schema from its type hints and Google-style docstring, or a ``ValueError`` naming the tool
    and what to write."""
    try:
        return get_json_schema(function)
    except Exception as error:  # transformers' TypeError / DocstringParsingException
        name = getattr(function, "__name__", repr(function))
        raise ValueError(
            f"Tool {name!r} cannot be described to the model: {error}. A tool needs type hints on every argument and "
            "a Google-style docstring with a description and an 'Args:' entry per argument."
        ) from error


def tool_call_parser(tokenizer) -> Callable[[list[int], list[int], list[dict]], tuple[dict, list[ToolCall]]]:
    """``parse(turn_ids, prefix_ids, schemas) -> (assistant message, calls)`` for ``tokenizer``: with its
    ``response_template`` (set by trl's ``add_response_schema`` when the chat template is one trl knows) the message
    is trl's ``parse_response`` of the turn (TRL GRPO's ``completions`` entry: ``content`` and ``tool_calls``), else
    the Hermes ``<tool_call>`` format, the message the decoded text with the parsed calls."""
    decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
    if getattr(tokenizer, "response_template", None) is None:
        from trl.chat_template_utils import add_response_schema

        try:
            add_response_schema(tokenizer)
        except ValueError:  # a chat template trl does not know: Hermes blocks

            def hermes(ids: list[int], prefix: list[int], schemas: list[dict]) -> tuple[dict, list[ToolCall]]:
                text = decode(ids)
                calls = parse_tool_calls(tokenizer.decode(ids))
                message = {"role": "assistant", "content": _HERMES.sub("", text).strip()}
                if any(call.error is None for call in calls):
                    message["tool_calls"] = [_as_message_call(call) for call in calls if call.error is None]
                return message, calls

            return hermes

    from trl.chat_template_utils import parse_response

    def parse(ids: list[int], prefix: list[int], schemas: list[dict]) -> tuple[dict, list[ToolCall]]:
        text, prefix_text = tokenizer.decode(ids), tokenizer.decode(prefix)
        try:
            calls = tokenizer.parse_response(text, prefix=prefix_text, tools=schemas).get("tool_calls") or []
            calls = [_from_message_call(call) for call in calls]
        except Exception as error:  # the template's parser refused the turn
            calls = [ToolCall(error=f"the tool call could not be parsed: {error}")]
        try:
            message = parse_response(tokenizer, ids, prefix=prefix, tools=schemas)
        except Exception:  # as TRL falls back: the decoded text
            message = {"role": "assistant", "content": decode(ids)}
        return message, calls

    return parse


def _as_message_call(call: ToolCall) -> dict:
    return {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The Hermes-style calls of a turn: one per ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` block (an
    unclosed block is malformed too)."""
    calls = [_from_json(block) for block in _HERMES.findall(text)]
    if text.count("<tool_call>") > len(calls):
        calls.append(ToolCall(error="a <tool_call> block was not closed with </tool_call>"))
    return calls


def _from_json(block: str) -> ToolCall:
    try:
        call = json.loads(block)
    except json.JSONDecodeError as error:
        return ToolCall(error=f"the tool call is not JSON ({error.msg}): {block.strip()!r}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(error=f'a tool call needs {{"name": …, "arguments": {{…}}}}; got {block.strip()!r}')
    return _checked(call["name"], call.get("arguments", {}))


def _from_message_call(call: dict) -> ToolCall:
    function = call.get("function", call) if isinstance(call, dict) else {}
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return ToolCall(error=f"a tool call without a name: {call!r}")
    return _checked(function["name"], function.get("arguments", {}))


def _checked(name: str, arguments) -> ToolCall:
    if isinstance(arguments, str):  # some templates emit the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments or "{}")
    if not isinstance(arguments, dict):
        return ToolCall(name, error=f"the arguments of {name!r} must be an object; got {arguments!r}")
    return ToolCall(name, arguments)


class ToolRunner:
    """Runs parsed calls against a trajectory's tools (by name): sync tools in order, ``async def`` ones concurrently
    across the whole batch on a private event loop (so an already running loop, e.g. Jupyter's, is never blocked),
    each bounded by ``timeout`` seconds when given (a sync tool then runs in a worker thread, which is left to finish
    on its own). Returns, per call, ``(tool message, failed)``. :meth:`close` stops the loop's and workers' threads."""

    def __init__(self, *, timeout: float | None = None) -> None:
        self.timeout = timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._workers: concurrent.futures.ThreadPoolExecutor | None = None

    def run(self, batch: Sequence[tuple[dict[str, Callable], list[ToolCall]]]) -> list[list[tuple[dict, bool]]]:
        """``batch``: per trajectory, its tools by name and its calls of this turn."""
        results: list[list] = [[None] * len(calls) for _, calls in batch]
        pending = []
        for row, (tools, calls) in enumerate(batch):
            for index, call in enumerate(calls):
                outcome = self._start(tools, call)
                if inspect.isawaitable(outcome):
                    pending.append((row, index, call.name, outcome))
                else:
                    results[row][index] = outcome
        if pending:
            finished = self._await([outcome for *_, outcome in pending])
            for (row, index, name, _), value in zip(pending, finished, strict=True):
                results[row][index] = _message(name, value)
        return results

    def _start(self, tools: dict[str, Callable], call: ToolCall):
        if call.error is not None:
            return _failure(call.name or "unknown", call.error)
        if call.name not in tools:
            return _failure(call.name, f"there is no tool {call.name!r}; the tools are {sorted(tools)}")
        try:
            value = self._call(tools[call.name], call.arguments)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # a tool's own error (SystemExit too), arguments that do not fit, a timeout
            return _failure(call.name, f"{type(error).__name__}: {error}")
        return value if inspect.isawaitable(value) else _message(call.name, value)

    def _call(self, tool: Callable, arguments: dict):
        if self.timeout is None or inspect.iscoroutinefunction(tool):
            return tool(**arguments)
        if self._workers is None:
            self._workers = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="trl-ppomax-tool")
        try:
            return self._workers.submit(tool, **arguments).result(self.timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the tool ran past tool_timeout={self.timeout} s") from None

    def _await(self, awaitables: list) -> list:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=self._loop.run_forever, name="trl-ppomax-tools", daemon=True)
            self._loop_thread.start()

        async def guarded(awaitable):
            try:
                return await asyncio.wait_for(awaitable, self.timeout)
            except asyncio.TimeoutError:
                return TimeoutError(f"the tool ran past tool_timeout={self.timeout} s")
            except KeyboardInterrupt:
                raise
            except BaseException as error:  # SystemExit would otherwise stop the loop's thread
                return error

        async def gather():
            return await asyncio.gather(*(guarded(a) for a in awaitables))

        return asyncio.run_coroutine_threadsafe(gather(), self._loop).result()

    def close(self) -> None:
        """Stop the event loop's thread and the sync tools' workers (a tool still running is not waited for)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(10)
            if not self._loop_thread.is_alive():
                self._loop.close()
            self._loop = self._loop_thread = None
        if self._workers is not None:
            self._workers.shutdown(wait=False, cancel_futures=True)
            self._workers = None


def _message(name: str, value) -> tuple[dict, bool]:
    """A tool's result as TRL GRPO writes it: a list (content blocks) kept, anything else as ``str(value)``."""
    if isinstance(value, BaseException):
        return _failure(name, f"{type(value).__name__}: {value}")
    return {"role": "tool", "name": name, "content": value if isinstance(value, list) else str(value)}, False


def _failure(name: str, error: str) -> tuple[dict, bool]:
    return {"role": "tool", "name": name, "content": str({"error": error})}, True


def end_of_turn_token(tokenizer, chat_template_kwargs: dict | None = None) -> int | None:
    """The token the chat template ends an assistant turn with (Qwen's ``<|im_end|>``, Llama 3's ``<|eot_id|>``): the
    first token after an assistant message's content, if it is a special token; None without a chat template or
    such a token."""
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, **(chat_template_kwargs or {}))
    except Exception:  # no chat template
        return None
    start = rendered.find(_SENTINEL)
    if start < 0:
        return None
    after = tokenizer(rendered[start + len(_SENTINEL) :].lstrip(" "), add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | {
        i for i, token in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items() if token.special
    }
    return after[0] if after and after[0] in special else None


class ToolTurnTokens:
    """The tokens the environment inserts after a policy turn that ended with the stop token: the chat template's
    rendering of the tool messages and the next generation prompt, i.e. what follows ``<stop>`` in
    ``template([…, assistant, *tool messages], add_generation_prompt=True)``. The policy's own tokens are kept as it
    wrote them (token in, token out); only this suffix is tokenized. Checked at construction: a template that does not
    end an assistant turn with the stop token, or renders no tool messages, is refused with the fix."""

    def __init__(self, tokenizer, stop_token_id: int, chat_template_kwargs: dict | None = None) -> None:
        self.tokenizer, self.kwargs = tokenizer, dict(chat_template_kwargs or {})
        self.stop_text = tokenizer.decode([stop_token_id])
        probe = self.text([{"role": "tool", "name": "probe", "content": "probe result"}])
        if "probe result" not in probe:
            raise ValueError(
                "The chat template does not render {'role': 'tool'} messages: tools need a template that shows tool "
                "results to the model (e.g. Qwen's, Llama 3's), set with tokenizer.chat_template = …."
            )

    def text(self, tool_messages: list[dict]) -> str:
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}, *tool_messages]
        rendered = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **self.kwargs
        )
        after = rendered.find(_SENTINEL) + len(_SENTINEL)
        stop = rendered.find(self.stop_text, after)
        if rendered.find(_SENTINEL) < 0 or stop < 0 or rendered[after:stop].strip():
            raise ValueError(
                f"The chat template must end an assistant turn with the stop token {self.stop_text!r} (the token "
                "the policy's turn ends with) for tool results to follow it; set stop_token_id to the template's "
                "end-of-turn token."
            )
        return rendered[stop + len(self.stop_text) :]

    def __call__(self, tool_messages: list[dict]) -> list[int]:
        return self.tokenizer(self.text(tool_messages), add_special_tokens=False)["input_ids"]
