"""The ``llm`` judge: a model behind an OpenAI-compatible ``/chat/completions`` endpoint (OpenAI, vLLM, …) compares
the policy's and the baseline's answers pairwise, as in LLM-as-a-judge (Zheng et al. 2023).

* Template: a text file holding ``{question}``, ``{answer_a}`` and ``{answer_b}``, replaced in one pass (other braces
  stay as written; answers may contain anything). Text above the first line that is exactly ``---`` is the system
  message, the rest the user message; without such a line the whole file is the user message.
* Each pair is asked twice: ``policy_first`` (policy = A) and ``baseline_first`` (baseline = A). The last ``[[A]]`` /
  ``[[B]]`` / ``[[C]]`` (tie) of a reply decides; :func:`~trl_ppomax.judging.base.combine_swapped` joins the orders.
* Cache: ``"<pair.key>|<order>"`` → ``{"verdict", "label", "reply", "asks"}``, stored as each reply arrives.
* Transport: the ``openai`` client sends and retries the requests; we only choose the wait and log why.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from tqdm.auto import tqdm

from trl_ppomax.judging.base import JsonlCache, Pair, Verdict, combine_swapped, prompt_text

logger = logging.getLogger(__name__)

DEFAULT_TEMPLATE = Path(__file__).with_name("prompts") / "pairwise.txt"
PLACEHOLDERS = ("question", "answer_a", "answer_b")
ORDERS = ("policy_first", "baseline_first")  # every pair is asked in both: who is answer A
#: The judge's label → the verdict from the policy's side, per order.
LABEL_VERDICTS: dict[str, dict[str, Verdict]] = {
    "policy_first": {"A": "win", "B": "lose", "C": "tie"},
    "baseline_first": {"A": "lose", "B": "win", "C": "tie"},
}
_LABEL = re.compile(r"\[\[\s*([ABC])\s*\]\]")
_PLACEHOLDER = re.compile(r"\{(question|answer_a|answer_b)\}")
_SYSTEM_SEPARATOR = re.compile(r"^---[ \t]*$", re.MULTILINE)
_MAX_SERVER_MESSAGE = 500
#: Sent when there is no API key: openai always wants one, so it gets a stand-in and this drops its header.
_NO_AUTHORIZATION = {"Authorization": openai.Omit()}


class JudgeUnavailableError(RuntimeError):
    """The judge server kept failing (408, 409, 429, 5xx, timeout, connection error) through every retry."""


class JudgeRequestError(RuntimeError):
    """The judge server refused a request a retry cannot fix (another 4xx, or a reply that is no chat completion)."""


class JudgeAuthError(JudgeRequestError):
    """HTTP 401/403: the API key is missing or wrong."""


class _RetriesExhausted(Exception):
    """Internal: one request failed ``max_retries + 1`` times; ``judge()`` turns it into JudgeUnavailableError."""


def cache_key(pair: Pair, order: str) -> str:
    """``"<pair.key>|<order>"``, order in :data:`ORDERS`."""
    return f"{pair.key}|{order}"


def parse_label(reply: str) -> str | None:
    """The last ``[[A]]``, ``[[B]]`` or ``[[C]]`` in ``reply`` (``"A"``, ``"B"``, ``"C"``), or ``None``."""
    labels = _LABEL.findall(reply)
    return labels[-1] if labels else None


@dataclass(frozen=True)
class PromptTemplate:
    """A judge prompt: optional system message, user message with the placeholders, sha256 of the file's text."""

    system: str | None
    user: str
    sha256: str

    @classmethod
    def load(cls, path: str | os.PathLike) -> PromptTemplate:
        """Read a template; ``ValueError`` when the user part lacks a placeholder."""
        text = Path(path).read_text(encoding="utf-8")
        parts = _SYSTEM_SEPARATOR.split(text, maxsplit=1)
        system, user = (parts[0].strip() or None, parts[1].strip()) if len(parts) == 2 else (None, text.strip())
        missing = [name for name in PLACEHOLDERS if "{" + name + "}" not in user]
        if missing:
            raise ValueError(
                f"Judge prompt template {path} lacks {', '.join('{' + name + '}' for name in missing)}: its user "
                "message (below the first '---' line, if any) must hold {question}, {answer_a} and {answer_b}."
            )
        return cls(system, user, hashlib.sha256(text.encode("utf-8")).hexdigest())

    def messages(self, question: str, answer_a: str, answer_b: str) -> list[dict[str, str]]:
        """Chat messages with the three placeholders filled in."""
        values = {"question": question, "answer_a": answer_a, "answer_b": answer_b}
        user = _PLACEHOLDER.sub(lambda match: values[match.group(1)], self.user)
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": user}]


class _RetryHookClient(openai.OpenAI):
    """``openai.OpenAI`` that calls ``before_retry(retries_taken, response)`` in place of its own wait (0.5 s · 2ⁿ with
    jitter, at most 8 s, no public setting): ``_sleep_for_retry`` (openai ≥ 1.76) is the one place it waits. openai
    still decides what to retry and how often. ``response`` is ``None`` after a timeout or connection error."""

    def __init__(self, *, before_retry: Callable[[int, Any], None], **kwargs) -> None:
        super().__init__(**kwargs)
        self._before_retry = before_retry

    def _sleep_for_retry(self, *, retries_taken: int, max_retries: int, options: Any, response: Any) -> None:
        self._before_retry(retries_taken, response)


class LLMJudge:
    """Pairwise judge over an OpenAI-compatible chat-completions API; see the module docstring for the protocol.

    A failed request (429, 408, 409, 5xx, timeout, connection error) is retried up to ``max_retries`` times after
    ``min(Retry-After or backoff · 2**retry, max_backoff)`` seconds, then :class:`JudgeUnavailableError`; 401/403
    raise :class:`JudgeAuthError` and other 4xx :class:`JudgeRequestError` at once. A reply without a label is asked
    again up to ``parse_retries`` times, then counts as ``invalid``. ``api_key`` defaults to ``$OPENAI_API_KEY``
    (none: no ``Authorization`` header); it never appears in messages, logs, ``repr`` or the cache."""

    name = "llm"

    def __init__(
        self,
        model: str,
        base_url: str = "https://api.openai.com/v1",
        api_key: str | None = None,
        prompt: str | os.PathLike | None = None,
        max_retries: int = 6,
        timeout: float = 120.0,
        parse_retries: int = 2,
        backoff: float = 1.0,
        max_backoff: float = 60.0,
        concurrency: int = 4,
        temperature: float = 0.0,
        max_tokens: int = 1024,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if concurrency < 1 or max_retries < 0 or parse_retries < 0:
            raise ValueError("concurrency must be >= 1, max_retries and parse_retries >= 0")
        self.model, self.base_url = model, base_url.rstrip("/")
        self.url = f"{self.base_url}/chat/completions"
        self._api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.template = PromptTemplate.load(prompt if prompt is not None else DEFAULT_TEMPLATE)
        self.max_retries, self.timeout, self.parse_retries = max_retries, timeout, parse_retries
        self.backoff, self.max_backoff, self.concurrency = backoff, max_backoff, concurrency
        self.temperature, self.max_tokens, self._sleep = temperature, max_tokens, sleep

    def __repr__(self) -> str:
        key = "'***'" if self._api_key else None
        return f"LLMJudge(model={self.model!r}, base_url={self.base_url!r}, api_key={key})"

    def settings(self) -> dict:
        """What decides the verdicts (the key of the judge's cache); never the API key."""
        return {
            "model": self.model,
            "base_url": self.base_url,
            "prompt_sha256": self.template.sha256,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }

    def judge(self, pairs: Iterable[Pair], cache: JsonlCache) -> list[Verdict]:
        """One verdict per pair, in order: both orders asked (unless cached) on ``concurrency`` threads, joined by
        ``combine_swapped``; the first failure stops the other workers and is raised."""
        pairs = list(pairs)
        unique = list({pair.key: pair for pair in pairs}.values())
        todo = [pair for pair in unique if not all(cache_key(pair, order) in cache for order in ORDERS)]
        stop = threading.Event()
        bar = tqdm(total=len(unique), initial=len(unique) - len(todo), desc="Judging (llm)", unit="pair", disable=None)
        client = _RetryHookClient(  # its retries wait through _before_retry
            base_url=self.base_url,
            api_key=self._api_key or "no-key",  # its header is dropped per request (_NO_AUTHORIZATION)
            max_retries=self.max_retries,
            timeout=self.timeout,
            before_retry=functools.partial(self._before_retry, stop),
        )
        try:
            with client, bar, ThreadPoolExecutor(max_workers=self.concurrency) as pool:
                futures = [pool.submit(self._judge_pair, pair, cache, client, stop) for pair in todo]
                try:
                    for future in as_completed(futures):
                        future.result()
                        bar.update()
                except BaseException:
                    stop.set()
                    pool.shutdown(cancel_futures=True)  # running requests finish (and cache what they got)
                    raise
        except _RetriesExhausted as error:
            cached = sum(cache_key(pair, order) in cache for pair in unique for order in ORDERS)
            raise JudgeUnavailableError(
                f"The judge server at {self.url} kept failing ({error}) after {self.max_retries} retries. "
                f"{cached} of {len(unique) * len(ORDERS)} judgements ({len(unique)} pairs × {len(ORDERS)} orders) are "
                f"cached in {cache.path}; run the same command again to resume from them."
            ) from None
        return [combine_swapped(*(cache.get(cache_key(pair, order))["verdict"] for order in ORDERS)) for pair in pairs]

    def _judge_pair(self, pair: Pair, cache: JsonlCache, client: openai.OpenAI, stop: threading.Event) -> None:
        """Ask each order not cached yet, up to ``1 + parse_retries`` times, and cache what it decided."""
        for order in ORDERS:
            if cache_key(pair, order) in cache:
                continue
            first, second = (pair.policy, pair.baseline) if order == "policy_first" else (pair.baseline, pair.policy)
            messages = self.template.messages(prompt_text(pair.prompt), first, second)
            for ask in range(1, self.parse_retries + 2):
                reply = self._complete(client, messages, stop)
                label = parse_label(reply)
                if label is not None:
                    break
                logger.info("Judge reply for %s has no [[A]]/[[B]]/[[C]] (ask %d)", cache_key(pair, order), ask)
            verdict = LABEL_VERDICTS[order][label] if label is not None else "invalid"
            record = {"verdict": verdict, "label": label, "reply": self._redact(reply), "asks": ask}
            cache.put(cache_key(pair, order), record)

    def _complete(self, client: openai.OpenAI, messages: list[dict[str, str]], stop: threading.Event) -> str:
        """The reply text of one chat completion (openai retries transient failures); ``_RetriesExhausted`` when they
        last, :class:`JudgeRequestError` when the server refuses."""
        if stop.is_set():  # another request failed for good: send no more
            raise CancelledError
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=self.model,
                messages=messages,
                temperature=self.temperature,
                max_tokens=self.max_tokens,
                extra_headers=None if self._api_key else _NO_AUTHORIZATION,
            )
        except openai.APIStatusError as error:
            raise self._status_error(error.response) from None
        except openai.APIConnectionError as error:  # APITimeoutError included
            raise _RetriesExhausted(self._redact(f"{type(error).__name__}: {error.__cause__ or error}")) from None
        try:
            return raw.parse().choices[0].message.content or ""
        except (ValueError, AttributeError, IndexError, TypeError):
            raise JudgeRequestError(
                f"{self.url} did not answer with a chat completion (is base_url right? it usually ends in /v1): "
                f"{self._server_message(raw.http_response)}"
            ) from None

    def _before_retry(self, stop: threading.Event, retry: int, response: Any) -> None:
        """Log why, then wait ``min(Retry-After or backoff · 2**retry, max_backoff)``; ``CancelledError`` when another
        request already failed for good."""
        if stop.is_set():
            raise CancelledError
        delay, reason = self.backoff * 2**retry, "timeout or connection error"
        if response is not None:
            reason = f"HTTP {response.status_code}: {self._server_message(response)}"
            with contextlib.suppress(KeyError, ValueError):  # no Retry-After, or an HTTP date: ignored
                seconds = float(response.headers["Retry-After"])
                delay = max(seconds, 0.0) if math.isfinite(seconds) else delay
        delay = min(delay, self.max_backoff)
        message = "Judge request to %s failed (%s); retry %d/%d in %.2f s"
        logger.warning(message, self.url, reason, retry + 1, self.max_retries, delay)
        self._sleep(delay)

    def _status_error(self, response: Any) -> Exception:
        """The error for an HTTP error openai gave up on: retried until exhausted, a bad key, or a refusal."""
        status, message = response.status_code, self._server_message(response)
        if status in (408, 409, 429) or status >= 500:  # what openai retries
            return _RetriesExhausted(f"HTTP {status}: {message}")
        if status in (401, 403):
            return JudgeAuthError(
                f"The judge server at {self.url} refused the request (HTTP {status}: {message}). Check the API key "
                "in OPENAI_API_KEY (or the variable named by --api-key-env)."
            )
        return JudgeRequestError(f"The judge server at {self.url} refused the request (HTTP {status}): {message}")

    def _server_message(self, response: Any) -> str:
        """The server's error message (OpenAI's ``error.message``, vLLM's ``message``, else the body), truncated."""
        try:
            body = response.json()
            error = body.get("error", body)
            message = str(error.get("message", body) if isinstance(error, dict) else error)
        except (ValueError, AttributeError):
            message = response.text
        message = self._redact(message.strip())
        return message if len(message) <= _MAX_SERVER_MESSAGE else message[:_MAX_SERVER_MESSAGE] + "…"

    def _redact(self, text: str) -> str:
        return text.replace(self._api_key, "***") if self._api_key else text
