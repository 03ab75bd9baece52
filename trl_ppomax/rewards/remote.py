"""A reward model served over HTTP: :class:`RemoteRewardModel` (OpenRLHF's ``--remote_rm_url``), for scorers served
apart from training (a 70B model, an ensemble, a rule-based verifier). Standard library only (``urllib``, ``json``).

The protocol (JSON over HTTP POST, ``Content-Type: application/json``), one request per batch of ``batch_size``::

    request  {"query":       [sequence, ...],     # each prompt ⊕ response as the policy wrote it (see below)
              "prompts":     [prompt, ...],       # the prompt texts (for chat prompts: the conversations)
              "completions": [completion, ...],   # the response texts (for chat prompts: [{"role": "assistant", ...}])
              "<column>":    [value, ...], ...}   # the dataset's other columns (e.g. "labels", "solution")
    response {"rewards": [float, ...]}            # or {"scores": [...]}, or a bare JSON list; other keys are ignored
                                                  # one number per completion, in order; null drops that sample

``query`` is what OpenRLHF's client sends: in training, the policy's prompt and response token ids decoded once, as one
sequence, special tokens kept (the chat template's markers, an EOS the response ended with), padding removed, so no
word boundary is lost; otherwise :meth:`RemoteRewardModel.queries`. An OpenRLHF ``serve_rm`` server (``POST
/get_reward``, re-tokenizing ``query`` with ``add_special_tokens=False``) therefore works as it is: give it the URL
with its path, and the dataset a ``labels`` column if it reads labels.
"""

from __future__ import annotations

import http.client
import io
import json
import logging
import numbers
import reprlib
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
    or ``--reward_funcs http://host:8000/score``; the protocol is in the module docstring.

    The rollout is split into batches of ``batch_size`` (sent ``concurrency`` at a time), each one POST whose every
    attempt must be over within ``timeout`` seconds (connecting, sending, reading the whole answer). A connection
    error, a timeout, an HTTP 5xx or 429 is retried up to ``max_retries`` times, waiting ``backoff * 2**attempt``
    seconds before retry ``attempt`` (0, 1, ...); another 4xx is not. A batch that still fails, or an answer that is
    not one number per completion, raises a :class:`RemoteRewardError` naming the URL, the status or error and what to
    check, before the update: nothing is trained on a half-scored batch, and ``train(resume_from_checkpoint=True)``
    repeats the iteration once the server is back (other processes wait at their next collective until it times out).

    ``headers`` are added to each request (e.g. ``{"Authorization": "Bearer ..."}``; never logged). ``columns``
    names the dataset columns to send (None: all; JSON-serializable). ``score_key`` reads the scores from that key
    instead of ``rewards`` / ``scores``. ``name`` is the source's name in the ``rewards/<name>/mean`` metric.
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

    def __call__(
        self,
        prompts: list,
        completions: list,
        completion_ids=None,
        *,
        sequence_texts=None,
        trainer_state=None,
        log_metric=None,
        **columns,
    ) -> list[float | None]:
        """One score (or None) per completion, in order, from the server; ``completion_ids`` and the trainer's
        ``trainer_state`` and ``log_metric`` are not sent. The
        trainer's ``sequence_texts`` (:func:`~trl_ppomax.rewards.completion_texts`) are sent as ``query``, else
        :meth:`queries` of the texts."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions: give one prompt each.")
        if sequence_texts is not None and len(sequence_texts) != len(prompts):
            raise ValueError(f"{len(sequence_texts)} sequence_texts for {len(prompts)} completions: give one each.")
        if self.columns is not None:
            missing = sorted(set(self.columns) - set(columns))
            if missing:
                raise ValueError(
                    f"RemoteRewardModel columns {missing} are not in the dataset (it has {sorted(columns)})."
                )
            columns = {key: columns[key] for key in self.columns}

        def chunk(start: int) -> tuple:
            part = slice(start, start + self.batch_size)
            texts = None if sequence_texts is None else list(sequence_texts[part])
            return prompts[part], completions[part], {key: list(value[part]) for key, value in columns.items()}, texts

        batches = [chunk(start) for start in range(0, len(prompts), self.batch_size)]
        if self.concurrency == 1 or len(batches) == 1:
            scored = [self.score_batch(*batch) for batch in batches]
        else:
            with ThreadPoolExecutor(max_workers=min(self.concurrency, len(batches))) as pool:
                scored = list(pool.map(lambda batch: self.score_batch(*batch), batches))
        return [score for scores in scored for score in scores]

    def queries(self, prompts: list, completions: list) -> list:
        """OpenRLHF's ``query`` without ``sequence_texts``: ``prompt + completion`` for texts; for conversations the
        message list, or its text rendered with the chat template of ``tokenizer`` when one is given."""
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

    def score_batch(
        self, prompts: list, completions: list, columns: dict | None = None, sequence_texts: list | None = None
    ) -> list[float | None]:
        """The scores of one batch: one POST, retried as the class docstring says, the answer checked. ``query`` is
        ``sequence_texts`` when given, else :meth:`queries`."""
        payload = {**(columns or {}), "prompts": prompts, "completions": completions}
        payload["query"] = list(sequence_texts) if sequence_texts is not None else self.queries(prompts, completions)
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
                text = self._attempt(request)
                break
            except urllib.error.HTTPError as error:
                status, problem = error.code, f"HTTP {error.code} {error.reason}: {_excerpt(error)}"
                if not (status >= 500 or status == 429):
                    raise fault(
                        f"The reward server at {self.url} refused the request ({problem}). A 4xx is not retried: "
                        "check the URL's path, the headers (authentication) and that the server speaks this protocol "
                        "(POST JSON {prompts, completions, query} -> {rewards: [...]}; see trl_ppomax.rewards.remote).",
                        status,
                    ) from error
            except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
                reason = getattr(error, "reason", error)
                timed_out = isinstance(reason, TimeoutError) or isinstance(error, TimeoutError)
                problem = (
                    f"no complete answer within timeout={self.timeout:g} s (the deadline of each attempt)"
                    if timed_out
                    else f"{type(reason).__name__}: {reason}"
                )
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
                f"The reward server at {self.url} answered with invalid JSON ({error}): {_shown(text)}"
            ) from error

    def _attempt(self, request: urllib.request.Request) -> bytes:
        """The body of the answer to one attempt of ``request``, all of it received within ``timeout`` seconds of
        the start (a ``TimeoutError`` when not); the HTTP errors as ``urllib`` raises them."""
        opener = urllib.request.build_opener(_DeadlineHandler(time.monotonic() + self.timeout))  # replaces urllib's
        with opener.open(request, timeout=self.timeout) as response:
            return response.read()

    def _scores(self, answer, prompts: list, completions: list) -> list[float | None]:
        """The scores in ``answer``, checked: a list of numbers (or nulls), one per completion."""

        def fault(problem: str) -> RemoteRewardError:
            message = (
                f"The reward server at {self.url} {problem}; it must answer "
                '{"rewards": [one number per completion]} (or "scores", or a bare list).'
            )
            return RemoteRewardError(message, self.url, 200, prompts, completions)

        scores = answer
        if isinstance(answer, dict):
            keys = (self.score_key,) if self.score_key else SCORE_KEYS
            found = [key for key in keys if key in answer]
            if not found:
                raise fault(f"answered without a {' or '.join(map(repr, keys))} key: {_shown(answer)}")
            scores = answer[found[0]]
        if not isinstance(scores, list):
            raise fault(f"answered {type(scores).__name__} {_shown(scores)}, not a list of scores")
        if len(scores) != len(prompts):
            raise fault(f"answered {len(scores)} scores for a batch of {len(prompts)} completions")
        wrong = [s for s in scores if s is not None and (isinstance(s, bool) or not isinstance(s, numbers.Real))]
        if wrong:
            example = f"{type(wrong[0]).__name__} {_shown(wrong[0])}"
            raise fault(f"answered {len(wrong)} score(s) that are not numbers (e.g. {example})")
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
    raise TypeError(f"{type(value).__name__} {_shown(value)} is not JSON-serializable")


def _excerpt(error: urllib.error.HTTPError) -> str:
    """The body of an HTTP error answer, for the message."""
    try:
        body = error.read()
    except Exception:  # the body of an error is only for the message
        return "(no body)"
    return _shown(body) if body else "(empty body)"


_SHOWN = reprlib.Repr()  # what a server sent, for the messages: strings quoted, long values elided with "..."
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlevel = 200, 200, 3
_SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict = 8, 8, 6


def _shown(value) -> str:
    """``value`` as received, shortened: its repr (a string quoted, a body of bytes decoded first), a long string cut
    in the middle and a long list or dict after a few items, each with ``...`` and its brackets closed."""
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode(errors="replace")
    return _SHOWN.repr(value)


# A deadline for a whole attempt. urllib's ``timeout`` bounds each socket operation, so a server that sends a byte
# every second never times out; these handlers give every connection of an attempt one deadline instead: connecting
# gets the time left, and each send and each read of the socket is given the time left (a TimeoutError once none is).
def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the attempt's deadline passed")
    return left


class _DeadlineSocket:
    """A connected socket (plain or TLS) whose ``sendall`` and the reads of its ``makefile("rb")`` (all that
    ``http.client`` uses) end by ``deadline`` (``time.monotonic()``); everything else is the socket's own."""

    def __init__(self, sock, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def sendall(self, data, *flags):
        self._sock.settimeout(_time_left(self._deadline))  # sendall's timeout bounds the whole call
        return self._sock.sendall(data, *flags)

    def makefile(self, mode="r", buffering=None, **kwargs):
        if mode != "rb":
            return self._sock.makefile(mode, buffering, **kwargs)
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def __getattr__(self, name):
        return getattr(self._sock, name)


class _DeadlineReader(io.RawIOBase):
    """The socket's raw reader, each read given the time left before ``deadline``."""

    def __init__(self, sock, deadline: float) -> None:
        super().__init__()
        self._sock, self._deadline = sock, deadline
        self._raw = sock.makefile("rb", buffering=0)  # keeps the socket open until this reader is closed

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int | None:
        self._sock.settimeout(_time_left(self._deadline))
        return self._raw.readinto(buffer)

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


class _DeadlineConnection(http.client.HTTPConnection):
    """An ``HTTPConnection`` whose connecting, sending and reading all end by ``deadline``."""

    def __init__(self, *args, deadline: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    def connect(self) -> None:
        self.timeout = _time_left(self.deadline)
        super().connect()  # for HTTPS also the proxy tunnel and the TLS handshake, each step within the time left
        self.sock = _DeadlineSocket(self.sock, self.deadline)


class _DeadlineHTTPSConnection(_DeadlineConnection, http.client.HTTPSConnection):
    pass


class _DeadlineHandler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    """urllib's HTTP and HTTPS handler (``build_opener`` then drops its default ones) with one ``deadline``."""

    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(_DeadlineConnection, req, deadline=self.deadline)

    def https_open(self, req):
        return self.do_open(_DeadlineHTTPSConnection, req, deadline=self.deadline)  # urllib's default TLS context
