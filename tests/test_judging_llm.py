"""The ``llm`` judge against a real local HTTP server speaking the OpenAI chat-completions format: swapped orders,
label parsing and re-asking, retries and back-off, caching and resuming, and the API key kept secret."""

from __future__ import annotations

import hashlib
import http.server
import json
import logging
import random
import re
import socket
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from trl_ppomax.judging.base import JsonlCache, Pair
from trl_ppomax.judging.llm import (
    DEFAULT_TEMPLATE,
    JudgeAuthError,
    JudgeRequestError,
    JudgeUnavailableError,
    LLMJudge,
    cache_key,
    parse_label,
)

KEY = "sk-test-SECRET"


# -- the fake judge server -------------------------------------------------------------------------------------------


@dataclass
class Request:
    """One POST the server received (header names in lower case); ``status`` is what it answered."""

    path: str
    headers: dict[str, str]
    body: dict
    status: int = 0

    @property
    def user(self) -> str:
        return self.body["messages"][-1]["content"]

    @property
    def answers(self) -> tuple[str, str]:
        """(answer in position A, answer in position B), as the default template lays them out."""
        a = re.search(r"<answer_a>\n(.*?)\n</answer_a>", self.user, re.DOTALL).group(1)
        b = re.search(r"<answer_b>\n(.*?)\n</answer_b>", self.user, re.DOTALL).group(1)
        return a, b


#: What a behaviour returns: a reply's text (HTTP 200), or ``(status, body, headers)``.
Reply = str | tuple[int, object, dict]


@dataclass
class FakeJudgeServer:
    base_url: str = ""
    behaviour: Callable[[Request], Reply] = field(default=lambda request: prefer_good(request))
    requests: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def respond(self, request: Request) -> tuple[int, bytes, dict]:
        with self.lock:
            self.requests.append(request)
        reply = self.behaviour(request)
        status, body, headers = (200, completion(reply), {}) if isinstance(reply, str) else reply
        request.status = status
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        return status, data, headers


def completion(content: str) -> dict:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": "judge",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def prefer_good(request: Request) -> str:
    """[[A]] / [[B]] for the only answer containing "good", else [[C]]."""
    a, b = ("good" in answer for answer in request.answers)
    label = "A" if a and not b else "B" if b and not a else "C"
    return f"Comparing the two answers carefully.\n[[{label}]]"


def make_handler(server: FakeJudgeServer):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/chat/completions":
                status, data, headers = 404, b'{"error": {"message": "no such route"}}', {}
            else:
                sent = {name.lower(): value for name, value in self.headers.items()}
                status, data, headers = server.respond(Request(self.path, sent, body))
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client gave up (a timeout test)
                pass

        def log_message(self, *args):
            pass

    return Handler


@pytest.fixture
def server():
    fake = FakeJudgeServer()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), make_handler(fake))
    httpd.handle_error = lambda request, address: None
    fake.base_url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield fake
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def _environment(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


# -- helpers ---------------------------------------------------------------------------------------------------------


def make_pairs(outcomes: list[str]) -> list[Pair]:
    """Pair i's policy answer is "good" for "win", its baseline's for "lose", neither for "tie"."""
    pairs = []
    for i, outcome in enumerate(outcomes):
        policy = f"{'good' if outcome == 'win' else 'plain'} answer {i} from the policy"
        baseline = f"{'good' if outcome == 'lose' else 'plain'} answer {i} from the baseline"
        pairs.append(Pair(key=f"{i}-k{i}", prompt=f"Question number {i}?", policy=policy, baseline=baseline))
    return pairs


def make_judge(server: FakeJudgeServer, **kwargs) -> LLMJudge:
    kwargs = {"model": "judge-model", "base_url": server.base_url, "backoff": 0.001, "max_backoff": 0.01} | kwargs
    return LLMJudge(**kwargs)


class SleepRecorder(list):
    """An injectable ``sleep`` that records the delays and does not wait."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def nth_request(server: FakeJudgeServer) -> int:
    with server.lock:
        return len(server.requests)


# -- verdicts --------------------------------------------------------------------------------------------------------


def test_agreement_in_both_orders_gives_win_lose_tie_in_pair_order(server, tmp_path):
    outcomes = ["win", "lose", "tie", "win", "lose", "tie", "win", "win", "lose", "tie"]
    pairs = make_pairs(outcomes)
    pairs[0] = Pair(pairs[0].key, [{"role": "user", "content": "Hi there"}], pairs[0].policy, pairs[0].baseline)

    def jittery(request):
        time.sleep(random.uniform(0, 0.01))
        return prefer_good(request)

    server.behaviour = jittery
    cache = JsonlCache(tmp_path / "cache.jsonl")
    verdicts = make_judge(server, concurrency=4).judge(pairs, cache)

    assert verdicts == outcomes
    assert len(server.requests) == 2 * len(pairs)
    seen = Counter(request.answers for request in server.requests)
    for pair in pairs:
        assert seen[(pair.policy, pair.baseline)] == 1 and seen[(pair.baseline, pair.policy)] == 1
    first = server.requests[0].body
    assert first["model"] == "judge-model" and first["temperature"] == 0.0 and first["max_tokens"] == 1024
    assert [m["role"] for m in first["messages"]] == ["system", "user"]
    assert "authorization" not in server.requests[0].headers
    assert any("User: Hi there" in request.user for request in server.requests)
    win = cache.get(cache_key(pairs[0], "baseline_first"))
    assert win == {"verdict": "win", "label": "B", "reply": "Comparing the two answers carefully.\n[[B]]", "asks": 1}
    assert len(JsonlCache(tmp_path / "cache.jsonl")) == 2 * len(pairs)


def test_position_bias_disagreement_is_a_tie_and_the_last_label_decides(server, tmp_path):
    server.behaviour = lambda request: "At first I leaned to [[B]], but on reflection: [[A]]"
    verdicts = make_judge(server).judge(make_pairs(["win", "lose", "tie"]), JsonlCache(tmp_path / "c.jsonl"))
    assert verdicts == ["tie", "tie", "tie"]


def test_parse_label():
    assert parse_label("[[A]] no, [[ C ]]") == "C"
    assert parse_label("Answer A is better. [A]") is None
    assert parse_label("") is None


def test_unparseable_reply_is_asked_again(server, tmp_path):
    asked = Counter()

    def vague_first(request):
        asked[request.answers] += 1
        return "Both have merits." if asked[request.answers] == 1 else prefer_good(request)

    server.behaviour = vague_first
    cache = JsonlCache(tmp_path / "c.jsonl")
    pairs = make_pairs(["win", "lose"])
    assert make_judge(server).judge(pairs, cache) == ["win", "lose"]
    assert len(server.requests) == 2 * 2 * 2
    assert all(
        cache.get(cache_key(pair, order))["asks"] == 2
        for pair in pairs
        for order in ("policy_first", "baseline_first")
    )


def test_always_unparseable_is_invalid_not_an_error(server, tmp_path):
    server.behaviour = lambda request: "I would rather not choose."
    cache = JsonlCache(tmp_path / "c.jsonl")
    pairs = make_pairs(["win", "tie"])
    assert make_judge(server, parse_retries=2).judge(pairs, cache) == ["invalid", "invalid"]
    assert len(server.requests) == len(pairs) * 2 * (1 + 2)
    assert cache.get(cache_key(pairs[0], "policy_first")) == {
        "verdict": "invalid",
        "label": None,
        "reply": "I would rather not choose.",
        "asks": 3,
    }


# -- rate limits and failures ----------------------------------------------------------------------------------------


def test_rate_limit_is_retried_after_retry_after(server, tmp_path):
    def limited_once(request):
        if nth_request(server) == 1:
            return 429, {"error": {"message": "Rate limit reached"}}, {"Retry-After": "0"}
        return prefer_good(request)

    server.behaviour = limited_once
    sleep = SleepRecorder()
    verdicts = make_judge(server, sleep=sleep).judge(make_pairs(["win"]), JsonlCache(tmp_path / "c.jsonl"))
    assert verdicts == ["win"]
    assert len(server.requests) == 2 + 1
    assert sleep == [0.0]


def test_server_errors_back_off_exponentially_with_a_cap(server, tmp_path):
    def flaky(request):
        return (503, "overloaded", {}) if nth_request(server) <= 3 else prefer_good(request)

    server.behaviour = flaky
    sleep = SleepRecorder()
    judge = make_judge(server, backoff=0.5, max_backoff=1.5, sleep=sleep)
    assert judge.judge(make_pairs(["lose"]), JsonlCache(tmp_path / "c.jsonl")) == ["lose"]
    assert sleep == [0.5, 1.0, 1.5]  # our schedule, not openai's: also fails if openai stops calling our retry hook


def test_timeouts_are_retried(server, tmp_path):
    def slow_first(request):
        if nth_request(server) == 1:
            time.sleep(0.6)
        return prefer_good(request)

    server.behaviour = slow_first
    verdicts = make_judge(server, timeout=0.2).judge(make_pairs(["win"]), JsonlCache(tmp_path / "c.jsonl"))
    assert verdicts == ["win"]
    assert len(server.requests) == 3


def test_unreachable_server_is_a_clear_error(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    judge = LLMJudge("judge-model", base_url=f"http://127.0.0.1:{port}/v1", max_retries=1, backoff=0.001)
    with pytest.raises(JudgeUnavailableError, match=re.escape(f"127.0.0.1:{port}/v1/chat/completions")) as error:
        judge.judge(make_pairs(["win"]), JsonlCache(tmp_path / "c.jsonl"))
    assert "ConnectionError" in str(error.value) and "0 of 2" in str(error.value)


def test_persistent_server_errors_raise_after_max_retries_keeping_earlier_verdicts(server, tmp_path):
    def dies_after_two_pairs(request):
        return prefer_good(request) if nth_request(server) <= 4 else (500, "internal error", {})

    server.behaviour = dies_after_two_pairs
    pairs = make_pairs(["win", "lose", "tie"])
    judge = make_judge(server, max_retries=2, concurrency=1)
    with pytest.raises(JudgeUnavailableError) as error:
        judge.judge(pairs, JsonlCache(tmp_path / "c.jsonl"))

    message = str(error.value)
    assert server.base_url + "/chat/completions" in message
    assert "HTTP 500" in message and "after 2 retries" in message
    assert "4 of 6 judgements" in message and "run the same command again to resume" in message
    assert len(server.requests) == 4 + (1 + 2)
    cache = JsonlCache(tmp_path / "c.jsonl")
    assert len(cache) == 4
    assert [cache.get(cache_key(pairs[0], o))["verdict"] for o in ("policy_first", "baseline_first")] == ["win"] * 2
    assert [cache.get(cache_key(pairs[1], o))["verdict"] for o in ("policy_first", "baseline_first")] == ["lose"] * 2


def test_a_request_failing_for_good_stops_the_other_workers_retrying(server, tmp_path):
    refused, overloaded = make_pairs(["win", "lose"])

    def behaviour(request):
        if refused.policy in request.answers:
            return 400, {"error": {"message": "bad request"}}, {}
        return 503, "overloaded", {}

    server.behaviour = behaviour
    judge = make_judge(server, max_retries=5, concurrency=2, sleep=lambda seconds: time.sleep(0.1))
    with pytest.raises(JudgeRequestError, match="HTTP 400"):
        judge.judge([refused, overloaded], JsonlCache(tmp_path / "c.jsonl"))
    retried = [request for request in server.requests if overloaded.policy in request.answers]
    assert 1 <= len(retried) < 1 + 5


def test_other_client_errors_fail_at_once_with_the_server_message(server, tmp_path):
    long_tail = "x" * 2000
    server.behaviour = lambda request: (400, {"error": {"message": f"model 'judge-model' not found {long_tail}"}}, {})
    with pytest.raises(JudgeRequestError, match=r"HTTP 400.*model 'judge-model' not found") as error:
        make_judge(server).judge(make_pairs(["win"]), JsonlCache(tmp_path / "c.jsonl"))
    assert len(str(error.value)) < 700
    assert len(server.requests) == 1


def test_a_reply_that_is_not_a_chat_completion_is_a_clear_error(server, tmp_path):
    server.behaviour = lambda request: (200, "<html>not an API</html>", {})
    with pytest.raises(JudgeRequestError, match="did not answer with a chat completion"):
        make_judge(server).judge(make_pairs(["win"]), JsonlCache(tmp_path / "c.jsonl"))


# -- resuming --------------------------------------------------------------------------------------------------------


def test_resume_after_a_crash_sends_no_request_already_answered(server, tmp_path):
    outcomes = ["win", "lose", "tie", "win", "lose", "tie"]
    pairs = make_pairs(outcomes)
    server.behaviour = lambda request: prefer_good(request) if nth_request(server) <= 5 else (500, "down", {})
    with pytest.raises(JudgeUnavailableError, match="5 of 12 judgements"):
        make_judge(server, max_retries=0, concurrency=2).judge(pairs, JsonlCache(tmp_path / "c.jsonl"))
    answered = {request.answers for request in server.requests if request.status == 200}
    assert len(answered) == 5

    server.requests.clear()
    server.behaviour = prefer_good
    verdicts = make_judge(server).judge(pairs, JsonlCache(tmp_path / "c.jsonl"))
    assert verdicts == outcomes
    resent = [request.answers for request in server.requests]
    assert not answered & set(resent)
    assert len(resent) == len(set(resent)) == 12 - 5

    server.requests.clear()
    assert make_judge(server).judge(pairs, JsonlCache(tmp_path / "c.jsonl")) == outcomes
    assert server.requests == []


# -- the API key -----------------------------------------------------------------------------------------------------


def test_api_key_is_sent_but_never_stored_or_shown(server, tmp_path, caplog):
    def echo_header(request):
        if nth_request(server) == 1:
            return 429, {"error": {"message": f"slow down, {request.headers['authorization']}"}}, {"Retry-After": "0"}
        return f"You sent {request.headers['authorization']}. [[A]]"

    server.behaviour = echo_header
    judge = make_judge(server, api_key=KEY)
    with caplog.at_level(logging.DEBUG):  # every logger: ours, openai's and its HTTP library's
        assert judge.judge(make_pairs(["win"]), JsonlCache(tmp_path / "c.jsonl")) == ["tie"]

    assert all(request.headers["authorization"] == f"Bearer {KEY}" for request in server.requests)
    assert "slow down" in caplog.text
    for text in ((tmp_path / "c.jsonl").read_text(), json.dumps(judge.settings()), repr(judge), caplog.text):
        assert "SECRET" not in text
    assert "***" in repr(judge)


def test_api_key_from_the_environment(server, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    make_judge(server).judge(make_pairs(["win"]), JsonlCache(tmp_path / "c.jsonl"))
    assert server.requests[0].headers["authorization"] == f"Bearer {KEY}"


def test_rejected_key_fails_at_once_without_showing_it(server, tmp_path):
    server.behaviour = lambda request: (401, {"error": {"message": f"Incorrect API key provided: {KEY}"}}, {})
    with pytest.raises(JudgeAuthError) as error:
        make_judge(server, api_key=KEY).judge(make_pairs(["win"]), JsonlCache(tmp_path / "c.jsonl"))
    message = "".join(traceback.format_exception(error.value))
    assert "OPENAI_API_KEY" in message and "--api-key-env" in message and "HTTP 401" in message
    assert "SECRET" not in message
    assert len(server.requests) == 1


def test_exhausted_retries_do_not_show_the_key(server, tmp_path, caplog):
    server.behaviour = lambda request: (502, f"bad gateway for {request.headers['authorization']}", {})
    with caplog.at_level(logging.DEBUG), pytest.raises(JudgeUnavailableError) as error:
        make_judge(server, api_key=KEY, max_retries=1).judge(make_pairs(["win"]), JsonlCache(tmp_path / "c.jsonl"))
    message = "".join(traceback.format_exception(error.value))
    assert "bad gateway for Bearer ***" in message
    assert "SECRET" not in message and "SECRET" not in caplog.text


# -- templates -------------------------------------------------------------------------------------------------------


def test_custom_template_is_used_and_braces_in_answers_are_kept(server, tmp_path):
    template = tmp_path / "mine.txt"
    template.write_text(
        "Be strict.\n---\nQ: {question}\nFIRST: {answer_a}\nSECOND: {answer_b}\nEnd with [[A]], [[B]] or [[C]]. {x}\n"
    )
    server.behaviour = lambda request: "[[C]]"
    pair = Pair("0-k", "Why?", policy="use {answer_b} and {question} literally", baseline="a {b} c")
    judge = make_judge(server, prompt=template)
    assert judge.judge([pair], JsonlCache(tmp_path / "c.jsonl")) == ["tie"]

    messages = server.requests[0].body["messages"]
    assert messages[0] == {"role": "system", "content": "Be strict."}
    assert messages[1]["content"] == (
        "Q: Why?\nFIRST: use {answer_b} and {question} literally\nSECOND: a {b} c\nEnd with [[A]], [[B]] or [[C]]. {x}"
    )
    assert judge.settings() == {
        "model": "judge-model",
        "base_url": server.base_url,
        "prompt_sha256": hashlib.sha256(template.read_bytes()).hexdigest(),
        "temperature": 0.0,
        "max_tokens": 1024,
    }
    assert judge.settings()["prompt_sha256"] != make_judge(server).settings()["prompt_sha256"]


def test_template_without_a_system_part_is_one_user_message(server, tmp_path):
    template = tmp_path / "plain.txt"
    template.write_text("{question}|{answer_a}|{answer_b}")
    server.behaviour = lambda request: "[[A]]"
    make_judge(server, prompt=template).judge(make_pairs(["win"]), JsonlCache(tmp_path / "c.jsonl"))
    assert [m["role"] for m in server.requests[0].body["messages"]] == ["user"]


def test_template_missing_a_placeholder_is_a_value_error(tmp_path):
    template = tmp_path / "broken.txt"
    template.write_text("Question: {question}\nA: {answer_a}\n")
    with pytest.raises(ValueError, match=r"lacks \{answer_b\}"):
        LLMJudge("judge-model", prompt=template)
    template.write_text("{question}\n---\n{answer_a} {answer_b}")  # the question went into the system part
    with pytest.raises(ValueError, match=r"lacks \{question\}"):
        LLMJudge("judge-model", prompt=template)


def test_shipped_template_has_the_placeholders():
    text = DEFAULT_TEMPLATE.read_text(encoding="utf-8")
    assert all(f"{{{name}}}" in text.split("\n---\n", 1)[1] for name in ("question", "answer_a", "answer_b"))
