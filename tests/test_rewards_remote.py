"""The remote reward source (:class:`trl_ppomax.RemoteRewardModel`) against a local HTTP server on 127.0.0.1:
batching and order, the request's fields, response shapes, a timeout, a 5xx then success, a 4xx, an unreachable URL,
wrong answers, the ``--reward_funcs URL`` form, and PPO-max training on it (with a server failure and a resume)."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import changed, make_trainer, snapshot

from trl_ppomax import RemoteRewardModel, rewards
from trl_ppomax.rewards import functions
from trl_ppomax.rewards.remote import RemoteRewardError
from trl_ppomax.toyworld.tiny import build_models

FAST = dict(max_retries=1, backoff=0.0)  # no waiting between attempts in the failure tests


class QuietHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass


class LoopbackServer:
    """An HTTP server on a free loopback port, answering in daemon threads; ``url`` ends with ``path``."""

    def serve(self, handler: type, path: str) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class RewardServer(LoopbackServer):
    """A reward server on 127.0.0.1 (a free port) in a thread. ``answer(payload, number) -> (status, body, delay)``
    decides each answer (``number`` counts requests from 0; a ``bytes`` body is sent as it is); ``payloads`` records
    every request."""

    def __init__(self) -> None:
        self.payloads: list[dict] = []
        self.answer = lambda payload, number: (200, {"rewards": [len(c) / 10 for c in payload["completions"]]}, 0)
        server = self

        class Handler(QuietHandler):
            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.payloads.append(payload)
                status, body, delay = server.answer(payload, len(server.payloads) - 1)
                time.sleep(delay)
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (a timeout test)
                    pass

        self.serve(Handler, "/score")


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")  # a proxy set in the environment must not intercept
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    running = RewardServer()
    yield running
    running.close()


def texts(n: int) -> tuple[list[str], list[str]]:
    return [f"prompt {i}: " for i in range(n)], [f"answer {i}" + "!" * i for i in range(n)]


@pytest.mark.parametrize("concurrency", [1, 3])
def test_batches_keep_order_and_send_the_protocol(server, concurrency):
    prompts, completions = texts(7)
    remote = RemoteRewardModel(server.url, batch_size=3, concurrency=concurrency)
    scores = remote(prompts, completions, solution=[str(i) for i in range(7)])
    assert scores == [len(c) / 10 for c in completions]  # in order, whatever order the batches were answered in
    assert sorted(len(p["prompts"]) for p in server.payloads) == [1, 3, 3]  # ceil(7 / 3) requests
    first = next(p for p in server.payloads if p["prompts"][0] == prompts[0])
    assert first["completions"] == completions[:3]
    assert first["query"] == [p + c for p, c in zip(prompts[:3], completions[:3], strict=True)]
    assert first["solution"] == ["0", "1", "2"]  # the dataset's other columns, batched alike


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"rewards": [1, 2.5]}, [1.0, 2.5]),  # OpenRLHF's serve_rm
        ({"scores": [1, None]}, [1.0, None]),  # null: the sample is dropped
        ({"rewards": [1, 2], "scores": [3, 4]}, [1.0, 2.0]),  # OpenRLHF's reward_func answers both: rewards win
        ([0.5, -0.5], [0.5, -0.5]),
    ],
)
def test_response_shapes(server, body, expected):
    server.answer = lambda payload, number: (200, body, 0)
    assert RemoteRewardModel(server.url)(*texts(2)) == expected


def test_a_5xx_then_success_is_retried(server, caplog):
    server.answer = lambda payload, number: (503, {"error": "loading"}, 0) if number == 0 else (200, [7.0], 0)
    with caplog.at_level(logging.WARNING, logger="trl_ppomax.rewards.remote"):
        assert RemoteRewardModel(server.url, backoff=0.01)(*texts(1)) == [7.0]
    assert len(server.payloads) == 2
    assert server.url in caplog.text and "503" in caplog.text and "retrying" in caplog.text


def test_a_timeout_is_retried_then_names_the_url(server):
    server.answer = lambda payload, number: (200, [1.0], 1.0)
    remote = RemoteRewardModel(server.url, timeout=0.2, **FAST)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"no complete answer within timeout=0\.2 s") as raised:
        remote(*texts(1))
    assert time.monotonic() - start < 1.5  # two attempts of 0.2 s, not the server's second
    assert server.url in str(raised.value) and "failed 2 time(s)" in str(raised.value)
    assert len(server.payloads) == 2
    assert raised.value.prompts == texts(1)[0]  # the batch that was not scored is kept


def test_an_unreachable_url_names_the_url():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/score"
    with pytest.raises(RemoteRewardError, match="Connection") as raised:
        RemoteRewardModel(url, **FAST)(*texts(2))
    assert url in str(raised.value) and "reachable" in str(raised.value)
    assert raised.value.status is None and raised.value.completions == texts(2)[1]


def test_a_4xx_is_not_retried(server):
    server.answer = lambda payload, number: (401, {"detail": "bad token"}, 0)
    with pytest.raises(RemoteRewardError, match="HTTP 401") as raised:
        RemoteRewardModel(server.url, headers={"Authorization": "Bearer x"}, max_retries=3)(*texts(1))
    assert server.url in str(raised.value) and "bad token" in str(raised.value) and raised.value.status == 401
    assert len(server.payloads) == 1


@pytest.mark.parametrize(
    "body, problem",
    [
        ({"rewards": [1.0]}, "answered 1 scores for a batch of 3"),
        ({"rewards": [1.0, "high", 2.0]}, "not numbers"),
        ({"rewards": [1.0, True, 2.0]}, "not numbers"),
        ({"reward": [1.0, 2.0, 3.0]}, "without a 'rewards' or 'scores' key"),
        (b"<html>oops</html>", "invalid JSON"),
    ],
)
def test_a_wrong_answer_names_the_url(server, body, problem):
    server.answer = lambda payload, number: (200, body, 0)
    with pytest.raises(RemoteRewardError, match=problem) as raised:
        RemoteRewardModel(server.url)(*texts(3))
    assert server.url in str(raised.value)
    assert len(server.payloads) == 1  # a wrong answer is the server's bug: not retried


def test_conversations_are_sent_as_messages(server):
    prompts = [[{"role": "user", "content": "hi"}]]
    completions = [[{"role": "assistant", "content": "hello"}]]
    RemoteRewardModel(server.url)(prompts, completions)
    assert server.payloads[0]["prompts"] == prompts and server.payloads[0]["completions"] == completions
    assert server.payloads[0]["query"] == [prompts[0] + completions[0]]

    class Template:
        def apply_chat_template(self, messages, tokenize):
            return "".join(f"<{m['role']}>{m['content']}" for m in messages)

    RemoteRewardModel(server.url, tokenizer=Template())(prompts, completions)
    assert server.payloads[1]["query"] == ["<user>hi<assistant>hello"]


def test_settings_are_checked_and_a_url_is_a_reward_function():
    for bad in ("127.0.0.1:8000/score", "ftp://host/x", "http://"):
        with pytest.raises(ValueError, match="http"):
            RemoteRewardModel(bad)
    with pytest.raises(ValueError, match="batch_size"):
        RemoteRewardModel("http://host/x", batch_size=0)
    loaded = rewards.load_reward_function("https://rm.example.com:8443/score")  # the CLI's --reward_funcs URL
    assert isinstance(loaded, RemoteRewardModel) and loaded.url == "https://rm.example.com:8443/score"
    assert not functions.is_positional_pair(loaded)  # called with keywords, as TRL's GRPO calls reward_funcs


SETTINGS = dict(
    gradient_accumulation_steps=1, num_mini_batches=1, total_episodes=8, save_strategy="steps", save_steps=1
)


def test_ppo_max_trains_on_a_remote_reward_and_resumes_after_a_failure(server, tmp_path):
    """Iteration 1 is scored and saved; iteration 2's server failure stops the run before any update (no checkpoint
    of it); the resumed run sends the same prompts again, trains and logs."""

    def healthy(payload, number):
        return 200, {"rewards": [len(c) / 10 for c in payload["completions"]]}, 0

    server.answer = lambda payload, number: healthy(payload, number) if number < 2 else (503, {}, 0)
    trainer = make_trainer(
        tmp_path,
        reward=[RemoteRewardModel(server.url, batch_size=3, **FAST)],
        value_model=build_models()[2],
        **SETTINGS,
    )
    before = snapshot(trainer.model.policy)
    with pytest.raises(RemoteRewardError, match="HTTP 503"):
        trainer.train()
    assert trainer.state.global_step == 1 and changed(before, trainer.model.policy) > 0
    assert (tmp_path / "out" / "checkpoint-1").is_dir() and not (tmp_path / "out" / "checkpoint-2").exists()
    assert [len(p["prompts"]) for p in server.payloads] == [3, 1, 3, 3]  # 4 prompts in batches of 3; one retry
    failed = server.payloads[2]["prompts"]

    server.payloads.clear()
    server.answer = healthy
    resumed = make_trainer(
        tmp_path, reward=[RemoteRewardModel(server.url, batch_size=3)], value_model=build_models()[2], **SETTINGS
    )
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2
    assert server.payloads[0]["prompts"] == failed  # the failed iteration's prompts are scored again, not lost
    logged = {key for entry in resumed.state.log_history for key in entry}
    assert {"objective/scores", "rewards/remote_reward/mean"} <= logged


@pytest.mark.slow  # the command line in its own process: 11 s cold (.ci/run runs it)
def test_the_command_line_takes_a_reward_server_url(server, tmp_path):
    """`trl-ppomax ppo --reward_funcs URL` adds the server to the reward model (two iterations of the tiny config)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {
        **os.environ,
        "PYTHONPATH": root,
        "HF_HUB_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "NO_PROXY": "127.0.0.1",
    }
    overrides = ["--total_episodes", "16", "--eval_strategy", "no", "--num_sample_generations", "0"]
    command = [sys.executable, "-m", "trl_ppomax.cli", "ppo", "--config", "tiny_cpu", "--reward_funcs", server.url]
    command += [*overrides, "--save_strategy", "no", "--disable_tqdm", "True"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert sum(len(p["completions"]) for p in server.payloads) == 16, [len(p["completions"]) for p in server.payloads]
    assert "rewards/remote_reward/mean" in result.stdout


# --------------------------------------------------------------------------------------------------------------------
# OpenRLHF's protocol: the query is the policy's prompt ⊕ response ids decoded once, special tokens kept
# --------------------------------------------------------------------------------------------------------------------
class OpenRLHFServer(LoopbackServer):
    """An OpenRLHF ``serve_rm``-style server on 127.0.0.1: ``POST /get_reward`` with ``{"query", "prompts", "labels"}``
    answers ``{"rewards", "scores", "extra_logs"}``, scoring each query with a tiny reward model after re-tokenizing it
    as serve_rm does (``add_special_tokens=False``). ``strip_eos``: as serve_rm did up to OpenRLHF's #1038, strip the
    leading and trailing pad / eos token texts, then append one eos; without it, as serve_rm does since, the query is
    tokenized as it came. Other paths answer 404; ``payloads`` records the requests."""

    def __init__(self, strip_eos: bool = True) -> None:
        import torch

        from trl_ppomax.toyworld.tiny import build_tokenizer

        self.tokenizer, self.strip_eos, self.payloads = build_tokenizer(), strip_eos, []
        self.model = build_models()[2].eval()
        self.torch = torch
        server = self

        class Handler(QuietHandler):
            def do_POST(self):
                data = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/get_reward":
                    self.send_error(404)
                    return
                server.payloads.append(data)
                try:
                    rewards = server.score(data["query"])
                except Exception:  # e.g. a query that is not a text: FastAPI's answer to a failing handler
                    self.send_error(500)
                    return
                body = json.dumps({"rewards": rewards, "scores": rewards, "extra_logs": {"dummy_scores": rewards}})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

        self.serve(Handler, "/get_reward")

    def score(self, queries: list[str]) -> list[float]:
        """The reward model's score of each query, as the server computes it (one query at a time: no padding)."""
        pad, eos = re.escape(self.tokenizer.pad_token), re.escape(self.tokenizer.eos_token)
        scores = []
        for query in queries:
            if self.strip_eos:
                query = (
                    re.sub(f"({eos}|{pad})+$", "", re.sub(f"^({eos}|{pad})+", "", query)) + self.tokenizer.eos_token
                )
            ids = self.tokenizer(query, add_special_tokens=False, return_tensors="pt")["input_ids"]
            with self.torch.no_grad():
                scores.append(self.model(input_ids=ids).logits[0, 0].item())
        return scores


@pytest.fixture(params=[True, False], ids=["serve_rm_strip_eos", "serve_rm_as_is"])
def openrlhf(request, monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    running = OpenRLHFServer(strip_eos=request.param)
    yield running
    running.close()


def rollout_batch(tokenizer, prompt_texts: list[str], response_texts: list[str]):
    """``(query_ids, query_mask, response_ids, response_mask)`` as a rollout holds them: the prompts left-padded, each
    response right-padded after its stop token (``</s>`` here), the masks 0 on padding."""
    import torch

    query = tokenizer(prompt_texts, add_special_tokens=False, padding=True, return_tensors="pt")
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in response_texts]
    width = max(map(len, rows))
    response_ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])
    response_mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    return query["input_ids"], query["attention_mask"], response_ids, response_mask


def openrlhf_queries(tokenizer, batch) -> list[str]:
    """What OpenRLHF's client sends as ``query``: each sequence without its padding, decoded once, special tokens
    kept."""
    query_ids, query_mask, response_ids, response_mask = batch
    return [
        tokenizer.decode(q[qm.bool()].tolist() + r[rm.bool()].tolist(), skip_special_tokens=False)
        for q, qm, r, rm in zip(query_ids, query_mask, response_ids, response_mask, strict=True)
    ]


def test_an_openrlhf_server_scores_the_sequence_the_policy_wrote(openrlhf):
    """The trainer's scoring path (RewardSources.score) sends OpenRLHF's query: "tell me a" ⊕ "story </s>" is
    "tell me a story </s>" (decoded apart and glued, it was "tell me astory": an unknown word), EOS kept when
    generated, a BOS in the prompt kept; the scores are the ones OpenRLHF's own client would get."""
    import torch

    from trl_ppomax.models import sequence_inputs

    tokenizer = openrlhf.tokenizer
    prompts = ["tell me a", "<s> hi how are you", "write a"]
    responses = ["story </s>", "good thanks </s>", "poem about the"]  # the last one truncated: no EOS
    batch = rollout_batch(tokenizer, prompts, responses)
    sources = rewards.RewardSources([RemoteRewardModel(openrlhf.url)])
    labels = ["l0", "l1", "l2"]
    _, per_source = sources.score(tokenizer, sequence_inputs(*batch), batch[1], batch[3], {"labels": labels})

    expected = openrlhf_queries(tokenizer, batch)
    assert expected == ["tell me a story </s>", "<s> hi how are you good thanks </s>", "write a poem about the"]
    (payload,) = openrlhf.payloads
    assert payload["query"] == expected
    assert payload["prompts"] == ["tell me a", "hi how are you", "write a"]  # decoded as before, specials skipped
    assert payload["labels"] == labels
    old = [p + r for p, r in zip(*rewards.completion_texts(tokenizer, batch, None)["texts"], strict=True)]
    assert old[0] == "tell me astory" and old[0] not in payload["query"]  # what the glued texts used to be
    assert per_source[:, 0].tolist() == pytest.approx(openrlhf.score(expected), abs=1e-6)
    assert not torch.allclose(per_source[:, 0], torch.tensor(openrlhf.score(old)))  # the glued text scores otherwise


def test_a_chat_prompt_is_sent_as_the_template_rendered_it(openrlhf):
    """For a conversation, the query is the chat template's text as the policy read it, plus its response."""
    from trl_ppomax.models import sequence_inputs

    tokenizer = openrlhf.tokenizer
    conversation = [{"role": "user", "content": "tell me a"}]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    batch = rollout_batch(tokenizer, [rendered], ["story </s>"])
    sources = rewards.RewardSources([RemoteRewardModel(openrlhf.url)])
    _, per_source = sources.score(tokenizer, sequence_inputs(*batch), batch[1], batch[3], {"prompt": [conversation]})
    (payload,) = openrlhf.payloads
    assert payload["query"] == ["user: tell me a </s> assistant: story </s>"] == openrlhf_queries(tokenizer, batch)
    assert payload["prompts"] == [conversation]
    assert payload["completions"] == [[{"role": "assistant", "content": "story"}]]
    assert per_source[:, 0].tolist() == pytest.approx(openrlhf.score(payload["query"]), abs=1e-6)


def test_ppo_max_trains_on_an_openrlhf_server(openrlhf, tmp_path, monkeypatch):
    """A PPO-max run on a serve_rm-style server: every query it receives is its rollout's prompt ⊕ response ids
    decoded once (recorded where the trainer builds what a reward source gets), the labels column comes along."""
    from datasets import Dataset

    from trl_ppomax.toyworld.tiny import prompt_texts

    seen = []
    build = rewards.completion_texts

    def recording(tokenizer, rollout_ids, columns):
        seen.extend(openrlhf_queries(tokenizer, rollout_ids))
        return build(tokenizer, rollout_ids, columns)

    monkeypatch.setattr(rewards, "completion_texts", recording)
    dataset = Dataset.from_dict({"prompt": prompt_texts(8), "labels": [f"label {i}" for i in range(8)]})
    trainer = make_trainer(
        tmp_path,
        reward=[RemoteRewardModel(openrlhf.url, batch_size=4)],
        value_model=build_models()[2],
        dataset=dataset,
        **{**SETTINGS, "save_strategy": "no"},
    )
    trainer.train()
    queries = [query for payload in openrlhf.payloads for query in payload["query"]]
    assert len(queries) == 8 and queries == seen
    assert all(any(query.startswith(prompt + " ") for prompt in dataset["prompt"]) for query in queries)
    assert {label for payload in openrlhf.payloads for label in payload["labels"]} <= set(dataset["labels"])
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert "rewards/remote_reward/mean" in logged


def test_our_protocol_gets_the_decoded_sequence_as_query_from_the_trainer_path(server):
    """Our own protocol's server gets the same ``query`` (and the texts as before) from the trainer's path."""
    from trl_ppomax.models import sequence_inputs
    from trl_ppomax.toyworld.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    batch = rollout_batch(tokenizer, ["tell me a"], ["story </s>"])
    rewards.RewardSources([RemoteRewardModel(server.url)]).score(
        tokenizer, sequence_inputs(*batch), batch[1], batch[3]
    )
    (payload,) = server.payloads
    assert payload["query"] == ["tell me a story </s>"]
    assert payload["prompts"] == ["tell me a"] and payload["completions"] == ["story"]


# --------------------------------------------------------------------------------------------------------------------
# A deadline for each whole attempt, and the messages
# --------------------------------------------------------------------------------------------------------------------
class DrippingServer(LoopbackServer):
    """A server that answers one byte every ``interval`` seconds: the body after the headers (``what="body"``), or
    the status line and headers themselves (``what="headers"``); it stops when the client has gone."""

    def __init__(self, what: str, interval: float = 0.3) -> None:
        body = json.dumps({"rewards": [1.0]}).encode() + b" " * 100

        class Handler(QuietHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                head = (
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                )
                if what == "body":
                    self.wfile.write(head)
                    self.wfile.flush()
                slow = head + body if what == "headers" else body
                try:
                    for index in range(len(slow)):
                        time.sleep(interval)
                        self.wfile.write(slow[index : index + 1])
                        self.wfile.flush()
                except OSError:  # the client gave up
                    pass

        self.serve(Handler, "/score")


@pytest.mark.parametrize("what", ["body", "headers"])
def test_a_dripping_server_is_cut_off_at_the_timeout(what, monkeypatch):
    """urllib's timeout is per socket read: a server sending a byte every 0.3 s kept a timeout=1 attempt waiting for
    its whole answer (40 s here). The deadline bounds the whole attempt."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    dripping = DrippingServer(what)
    try:
        start = time.monotonic()
        with pytest.raises(RemoteRewardError, match=r"no complete answer within timeout=1 s") as raised:
            RemoteRewardModel(dripping.url, timeout=1, max_retries=0)(*texts(1))
        elapsed = time.monotonic() - start
    finally:
        dripping.close()
    assert 0.9 < elapsed < 3.0, elapsed
    assert dripping.url in str(raised.value) and "failed 1 time(s)" in str(raised.value)


@pytest.mark.parametrize(
    "body, shown",
    [
        ({"rewards": [1.0, "0.6", 2.0]}, "(e.g. str '0.6')"),  # the string, quoted: not the number 0.6
        ({"rewards": ["high", None, 2.0]}, "(e.g. str 'high')"),
        ({"reward": list(range(500))}, "key: {'reward': [0, 1, 2, 3, 4, 5, 6, 7, ...]}"),  # cut cleanly
        ({"rewards": "0.6"}, "answered str '0.6', not a list of scores"),
        (b"<html>oops</html>", "): '<html>oops</html>'"),
    ],
)
def test_a_wrong_answer_is_shown_as_received(server, body, shown):
    server.answer = lambda payload, number: (200, body, 0)
    with pytest.raises(RemoteRewardError) as raised:
        RemoteRewardModel(server.url)(*texts(3))
    message = str(raised.value)
    assert shown in message, message
    if not isinstance(body, bytes):
        assert message.endswith(
            'it must answer {"rewards": [one number per completion]} (or "scores", or a bare list).'
        )


def test_a_long_body_is_cut_in_the_middle(server):
    server.answer = lambda payload, number: (500, b"<html>" + b"x" * 5000 + b"</html>", 0)
    with pytest.raises(RemoteRewardError) as raised:
        RemoteRewardModel(server.url, max_retries=0)(*texts(1))
    message = str(raised.value)
    assert "HTTP 500" in message and "'<html>xxx" in message and "xxx...xxx" in message
    assert "xxx</html>'." in message and len(message) < 1000
