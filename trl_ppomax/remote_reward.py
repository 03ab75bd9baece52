"""A reward model served over HTTP: :class:`RemoteRewardModel` (OpenRLHF's ``--remote_rm_url``).

Teams serve large reward models (a 70B scorer, an ensemble, a rule-based verifier) apart from training; the trainer
then only needs a reward function that POSTs the rollout's texts to the server and reads back one score per text.
Standard library only (``urllib.request``, ``json``), so the module imports nothing heavy.

The protocol (JSON over HTTP POST, ``Content-Type: application/json``), one request per batch of ``batch_size``::

    request  {"prompts":     [prompt, ...],       # the prompt texts (for chat prompts: the conversations)
              "completions": [completion, ...],   # the response texts (for chat prompts: [{"role": "assistant", ...}])
              "query":       [prompt + completion, ...],  # OpenRLHF's field: each whole text (see below)
              "<column>":    [value, ...], ...}   # the dataset's other columns (e.g. "solution", "labels")
    response {"rewards": [float, ...]}            # or {"scores": [...]}, or a bare JSON list
                                                  # one number per completion, in order; null drops that sample

``query`` is ``prompt + completion`` for text prompts; for conversations it is the whole conversation as a message
list, or its text rendered with the chat template of ``tokenizer`` when one is given (what an OpenRLHF
``serve_rm`` server expects). An OpenRLHF server (``{"query", "prompts", "labels"} -> {"rewards"}``) therefore works
as it is; give the dataset a ``labels`` column if it reads labels.
"""

from __future__ import annotations

import http.client
import json
import logging
import numbers
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

#: The keys a response's scores are read from, in this order, unless ``score_key`` is given.
SCORE_KEYS = ("rewards", "scores")


class RemoteRewardError(RuntimeError):
    """A reward server failed or answered wrongly. ``url``, ``status`` (the HTTP status, or None), and the batch that
    was not scored (``prompts``, ``completions``) are kept on the exception."""

    def __init__(self, message: str, url: str, status: int | None = None, prompts=(), completions=()) -> None:
        super().__init__(message)
        self.url, self.status = url, status
        self.prompts, self.completions = list(prompts), list(completions)


class RemoteRewardModel:
    """A reward function scored by an HTTP server: ``reward_funcs=[RemoteRewardModel("http://host:8000/score")]``,
    or ``--reward_funcs http://host:8000/score`` on the command line. See the module docstring for the protocol.

    The rollout is split into batches of ``batch_size`` (sent ``concurrency`` at a time), each one POST with a
    ``timeout`` in seconds (per connection attempt and per read). A connection error, a timeout, an HTTP 5xx or 429
    is retried up to ``max_retries`` times, waiting ``backoff * 2**attempt`` seconds before retry ``attempt``
    (0, 1, ...); another 4xx is not retried (the request itself is wrong). When a batch still fails, or the answer
    is not one number per completion, a :class:`RemoteRewardError` (a ``RuntimeError``) names the URL, the HTTP
    status or error, and what to check; it keeps the batch's texts.

    No rollout is lost: the error is raised while the rollout is scored, before the iteration's update, so nothing is
    trained on a half-scored batch and no checkpoint of that iteration is written; ``train(resume_from_checkpoint=
    True)`` repeats the iteration's prompts once the server is back. (With several processes, each sends its own
    share; when one fails, the others wait at their next collective operation until it times out.) A server that
    answers ``null`` for a sample drops that sample, as a reward function returning None does.

    ``headers`` are added to each request (e.g. ``{"Authorization": "Bearer ..."}``; never logged). ``columns``
    names the dataset columns to send (None: all; their values must be JSON-serializable). ``score_key`` reads the
    scores from that key of the response instead of ``rewards`` / ``scores``. ``name`` is the source's name in the
    ``rewards/<name>/mean`` metric.
    """

    def __init__(
        self,
        url: str,
        batch_size: int = 32,
        timeout: float = 120.0,
        max_retries: int = 5,
        backoff: float = 1.0,
        headers: Mapping[str, str] | None = None,
        *,
        concurrency: int = 1,
        tokenizer=None,
        columns: Sequence[str] | None = None,
        score_key: str | None = None,
        name: str = "remote_reward",
    ) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"RemoteRewardModel needs an http:// or https:// URL with a host, got {url!r}.")
        for field, value, low in (("batch_size", batch_size, 1), ("concurrency", concurrency, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"RemoteRewardModel {field} must be an integer >= {low}, got {value!r}.")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"RemoteRewardModel max_retries must be an integer >= 0, got {max_retries!r}.")
        if not timeout > 0 or not backoff >= 0:
            raise ValueError(f"RemoteRewardModel needs timeout > 0 and backoff >= 0, got {timeout!r}, {backoff!r}.")
        self.url, self.batch_size, self.timeout = url, batch_size, float(timeout)
        self.max_retries, self.backoff, self.concurrency = max_retries, float(backoff), concurrency
        self.headers = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
        self.tokenizer, self.score_key, self.__name__ = tokenizer, score_key, name
        self.columns = None if columns is None else list(columns)

    def __repr__(self) -> str:
        return (
            f"RemoteRewardModel({self.url!r}, batch_size={self.batch_size}, timeout={self.timeout}, "
            f"max_retries={self.max_retries}, backoff={self.backoff})"
        )

    def __call__(self, prompts: list, completions: list, completion_ids=None, **columns) -> list[float | None]:
        """One score (or None) per completion, in order, from the server; ``completion_ids`` are not sent."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions: give one prompt each.")
        if self.columns is not None:
            missing = sorted(set(self.columns) - set(columns))
            if missing:
                raise ValueError(
                    f"RemoteRewardModel columns {missing} are not in the dataset (it has {sorted(columns)})."
                )
            columns = {key: columns[key] for key in self.columns}
        starts = range(0, len(prompts), self.batch_size)
        batches = [
            (
                prompts[i : i + self.batch_size],
                completions[i : i + self.batch_size],
                {key: list(values[i : i + self.batch_size]) for key, values in columns.items()},
            )
            for i in starts
        ]
        if self.concurrency == 1 or len(batches) == 1:
            scored = [self.score_batch(*batch) for batch in batches]
        else:
            with ThreadPoolExecutor(max_workers=min(self.concurrency, len(batches))) as pool:
                scored = list(pool.map(lambda batch: self.score_batch(*batch), batches))
        return [score for scores in scored for score in scores]

    # ----------------------------------------------------------------------------------------------------------------
    def queries(self, prompts: list, completions: list) -> list:
        """OpenRLHF's ``query``: each prompt ⊕ completion (see the module docstring)."""
        queries = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if isinstance(prompt, str) and isinstance(completion, str):
                queries.append(prompt + completion)
                continue
            conversation = _messages(prompt, "user") + _messages(completion, "assistant")
            if self.tokenizer is not None:
                queries.append(self.tokenizer.apply_chat_template(conversation, tokenize=False))
            else:
                queries.append(conversation)
        return queries

    def score_batch(self, prompts: list, completions: list, columns: dict | None = None) -> list[float | None]:
        """The scores of one batch: one POST, retried as the class docstring says, the answer checked."""
        payload = {**(columns or {}), "prompts": prompts, "completions": completions}
        payload["query"] = self.queries(prompts, completions)
        try:
            body = json.dumps(payload, default=_json_default).encode()
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"RemoteRewardModel cannot send this batch to {self.url} as JSON: {error}. Restrict the dataset "
                "columns it sends with columns=[...] (columns=[] sends none)."
            ) from error
        answer = self._post(body, prompts, completions)
        return self._scores(answer, prompts, completions)

    def _post(self, body: bytes, prompts: list, completions: list):
        """The decoded JSON answer to ``body``, after the retries; a :class:`RemoteRewardError` when none succeeds."""

        def fault(message: str, status: int | None = None) -> RemoteRewardError:
            return RemoteRewardError(message, self.url, status, prompts, completions)

        attempts = self.max_retries + 1
        for attempt in range(attempts):
            status, problem = None, ""
            request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
            try:
                with urllib.request.build_opener().open(request, timeout=self.timeout) as response:
                    text = response.read()
                break
            except urllib.error.HTTPError as error:
                status, problem = error.code, f"HTTP {error.code} {error.reason}: {_excerpt(error)}"
                if not (status >= 500 or status == 429):
                    raise fault(
                        f"The reward server at {self.url} refused the request ({problem}). A 4xx is not retried: "
                        "check the URL's path, the headers (authentication) and that the server speaks this protocol "
                        "(POST JSON {prompts, completions, query} -> {rewards: [...]}; see trl_ppomax.remote_reward).",
                        status,
                    ) from error
            except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
                reason = getattr(error, "reason", error)
                timed_out = isinstance(reason, TimeoutError) or isinstance(error, TimeoutError)
                problem = f"no answer within {self.timeout:g} s" if timed_out else f"{type(reason).__name__}: {reason}"
            if attempt + 1 < attempts:
                wait = self.backoff * 2**attempt
                logger.warning(
                    "Reward server %s: %s (attempt %d of %d); retrying in %.3g s.",
                    self.url,
                    problem,
                    attempt + 1,
                    attempts,
                    wait,
                )
                time.sleep(wait)
        else:
            raise fault(
                f"The reward server at {self.url} failed {attempts} time(s) for a batch of {len(prompts)} "
                f"completion(s); last: {problem}. Check that the server is running and reachable from this machine "
                f"(e.g. curl -X POST {self.url}), that it answers within the timeout ({self.timeout:g} s; raise "
                "timeout= or lower batch_size=), and its logs for 5xx errors. In training, nothing was trained on "
                "this rollout: resume from the last checkpoint once the server is back.",
                status,
            )
        try:
            return json.loads(text)
        except ValueError as error:
            raise fault(
                f"The reward server at {self.url} answered with invalid JSON ({error}): {_short(text)}"
            ) from error

    def _scores(self, answer, prompts: list, completions: list) -> list[float | None]:
        """The scores in ``answer``, checked: a list of numbers (or nulls), one per completion."""

        def fault(problem: str) -> RemoteRewardError:
            message = (
                f'The reward server at {self.url} {problem}; it must answer {{"rewards": [one number per '
                'completion]}} (or "scores", or a bare list).'
            )
            return RemoteRewardError(message, self.url, 200, prompts, completions)

        scores = answer
        if isinstance(answer, dict):
            keys = (self.score_key,) if self.score_key else SCORE_KEYS
            found = [key for key in keys if key in answer]
            if not found:
                raise fault(f"answered without a {' or '.join(map(repr, keys))} key: {_short(answer)}")
            scores = answer[found[0]]
        if not isinstance(scores, list):
            raise fault(f"answered {type(scores).__name__} {_short(scores)}, not a list of scores")
        if len(scores) != len(prompts):
            raise fault(f"answered {len(scores)} scores for a batch of {len(prompts)} completions")
        wrong = [s for s in scores if s is not None and (isinstance(s, bool) or not isinstance(s, numbers.Real))]
        if wrong:
            raise fault(f"answered {len(wrong)} score(s) that are not numbers (e.g. {_short(wrong[0])})")
        return [None if s is None else float(s) for s in scores]


def _messages(value, role: str) -> list:
    """A prompt or completion as a message list (a text becomes one message of ``role``)."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return list(value)


def _json_default(value):
    """JSON for numpy and torch values in dataset columns (anything with ``tolist``)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} {_short(value)} is not JSON-serializable")


def _excerpt(error: urllib.error.HTTPError) -> str:
    try:
        return _short(error.read().decode(errors="replace")) or "(empty body)"
    except Exception:  # the body of an error is only for the message
        return "(no body)"


def _short(value, limit: int = 200) -> str:
    text = (
        value.decode(errors="replace")
        if isinstance(value, bytes)
        else repr(value)
        if not isinstance(value, str)
        else value
    )
    return text if len(text) <= limit else text[:limit] + "…"
