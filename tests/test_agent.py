"""Agent rollouts (``tools=``, ``environment_factory=``): the multi-turn loop token by token (a scripted policy on the
toy agent template and on Qwen 2.5's real template), tool failures logged and never raised, budgets, and runs that
train a tiny SFT agent (trl's SFTTrainer, saved with its tokenizer beside the weights) with tools and environments."""

from __future__ import annotations

import ast
import asyncio
import json

import pytest
import torch
from helpers import changed, snapshot
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)
from user_setups import qwen_style_tokenizer

from trl_ppomax import PPOMaxConfig, PPOMaxTrainer, data
from trl_ppomax.base import metrics as M
from trl_ppomax.generation.agent import AgentRollouts, EnvironmentReward
from trl_ppomax.generation.rollout_func import padded
from trl_ppomax.generation.tools import ToolRunner, ToolTurnTokens, parse_tool_calls, tool_call_parser, tool_schema
from trl_ppomax.toyworld.agent_task import (
    TOOL_CALL,
    AgentSettings,
    LookupEnvironment,
    agent_gold_reward,
    agent_prompts,
    agent_tokenizer,
    final_answer,
    prepare_agent_policy,
)

CONVERSATION = [{"role": "user", "content": "tell me about the secret topic"}]
ANSWER = "the cat is nice </s>"


class ScriptedPolicy:
    """A stand-in for the generation engine in the loop's unit tests: writes ``write(context text)`` as its next turn
    (token ids in, token ids out; at most ``max_new_tokens``)."""

    def __init__(self, tokenizer, write) -> None:
        self.tokenizer, self.write, self.contexts = tokenizer, write, []

    def generate(self, query_ids, query_mask, sampling=True, n=1, max_new_tokens=None):
        rows = []
        for ids, mask in zip(query_ids, query_mask, strict=True):
            context = self.tokenizer.decode(ids[mask.bool()])
            self.contexts.append(context)
            rows.append(self.tokenizer(self.write(context), add_special_tokens=False)["input_ids"][:max_new_tokens])
        responses, mask = padded(rows, self.tokenizer.pad_token_id, "right")
        return responses, mask, None


def call_then_answer(context: str) -> str:
    return ANSWER if "tool:" in context else f"{TOOL_CALL} </s>"


def agent_args(**overrides) -> PPOMaxConfig:
    return PPOMaxConfig(output_dir="unused", report_to="none", **{"response_length": 24, **overrides})


def run_agent(write, tools=(), environment=None, rows=None, n=1, tokenizer=None, **settings):
    tokenizer = tokenizer or agent_tokenizer()
    agent = AgentRollouts(agent_args(**settings), tokenizer, list(tools), environment, tokenizer.eos_token_id)
    policy = ScriptedPolicy(tokenizer, write)
    rows = rows if rows is not None else {"topic": ["dog"]}
    prompts = [CONVERSATION] * len(next(iter(rows.values())))
    out = agent.generate(policy, prompts, rows, True, n, tokenizer.pad_token_id, "cpu")
    return out, agent, policy, tokenizer


def tokens(tokenizer, ids, mask=None) -> list[str]:
    return tokenizer.convert_ids_to_tokens(ids if mask is None else ids[mask.bool()])


# ---- the loop, token by token -----------------------------------------------------------------------------------------


def test_a_trajectory_is_the_call_the_tool_result_and_the_answer_with_env_mask_0_on_the_result():
    out, agent, policy, tokenizer = run_agent(call_then_answer, environment=LookupEnvironment, n=2)
    call = [*TOOL_CALL.split(), "</s>"]
    result = ["tool:", "dog", "</s>", "assistant:"]
    for row in range(2):  # two samples of the prompt, each with its own environment
        assert tokens(tokenizer, out.response_ids[row], out.response_mask[row]) == [*call, *result, *ANSWER.split()]
        assert out.env_mask[row].tolist() == [1] * len(call) + [0] * len(result) + [1] * len(ANSWER.split())
    assert tokenizer.decode(out.query_ids[0][out.query_mask[0].bool()]).startswith("system: tools: lookup </s> user:")
    assert out.columns["environments"][0] is not out.columns["environments"][1]
    assert [e.topic for e in out.columns["environments"]] == ["dog", "dog"]  # reset(**row) got the row
    assert policy.contexts[-1].endswith("tool: dog </s> assistant:")  # the second turn sees the result
    assert agent.pop_metrics() == {
        M.TOOL_CALL_FREQUENCY: 1.0, M.TOOL_FAILURE_FREQUENCY: 0.0, M.TOOL_TURNS: 1.0, M.TOOL_FAILURE_RATE: 0.0
    }  # fmt: skip
    assert agent.pop_metrics() == {}  # popped


def test_max_tool_turns_bounds_the_tool_results_and_counts_the_calls_made():
    always_call = lambda context: f"{TOOL_CALL} </s>"  # noqa: E731
    out, agent, policy, _ = run_agent(always_call, environment=LookupEnvironment, max_tool_turns=2)
    assert out.env_mask[0].tolist().count(0) == 2 * 4 and len(policy.contexts) == 3  # 3 turns, 2 results
    assert agent.pop_metrics()[M.TOOL_CALL_FREQUENCY] == 2.0  # the calls run, as TRL counts them (not the last)
    out, agent, policy, _ = run_agent(always_call, environment=LookupEnvironment, max_tool_turns=0)
    assert int(out.env_mask[0].sum()) == int(out.response_mask[0].sum()) == 7 and len(policy.contexts) == 1


def test_response_length_bounds_the_policys_tokens_and_max_completion_tokens_the_whole_trajectory():
    out, *_ = run_agent(call_then_answer, environment=LookupEnvironment, response_length=10)
    assert int(out.env_mask[0].sum()) == 10 and int(out.response_mask[0].sum()) == 14  # 7 + 3 policy, 4 tool
    out, _agent, policy, _ = run_agent(call_then_answer, environment=LookupEnvironment, max_completion_tokens=9)
    assert out.env_mask[0].tolist() == [1] * 7 + [0] * 2 and len(policy.contexts) == 1  # the result cut, the end


def test_a_turn_without_a_call_or_cut_by_the_budget_ends_the_trajectory():
    out, agent, policy, _ = run_agent(lambda context: ANSWER, environment=LookupEnvironment)
    assert len(policy.contexts) == 1 and int(out.env_mask[0].sum()) == 5
    assert agent.pop_metrics() == {M.TOOL_CALL_FREQUENCY: 0.0, M.TOOL_FAILURE_FREQUENCY: 0.0, M.TOOL_TURNS: 0.0}
    out, agent, policy, _ = run_agent(call_then_answer, environment=LookupEnvironment, response_length=6)
    assert len(policy.contexts) == 1 and agent.pop_metrics()[M.TOOL_CALL_FREQUENCY] == 0.0  # no stop token


def test_a_tool_that_raises_and_a_malformed_call_are_logged_failures_and_the_trajectory_goes_on():
    def lookup() -> str:
        """Look up the topic."""
        raise RuntimeError("the index is down")

    calls = iter([f"{TOOL_CALL} </s>", '<tool_call> {"name": </tool_call> </s>', ANSWER])
    out, agent, policy, tokenizer = run_agent(lambda context: next(calls), tools=[lookup])
    assert len(policy.contexts) == 3 and tokens(tokenizer, out.response_ids[0])[-5:] == ANSWER.split()
    assert agent.pop_metrics()[M.TOOL_FAILURE_RATE] == 1.0


def test_failures_reach_the_policy_as_tool_messages_naming_the_error():
    runner = ToolRunner()

    def divide(a: int, b: int) -> float:
        """Divide.

        Args:
            a: numerator
            b: denominator
        """
        return a / b

    calls = parse_tool_calls(
        '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>'
        '<tool_call>{"name": "multiply", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "divide", "arguments": {"c": 1}}</tool_call>'
        "<tool_call>not json</tool_call><tool_call>{}</tool_call><tool_call>"
    )
    outcomes = runner.run([({"divide": divide}, calls)])[0]
    assert [failed for _, failed in outcomes] == [True] * 6
    errors = [ast.literal_eval(message["content"])["error"] for message, _ in outcomes]
    assert "ZeroDivisionError" in errors[0] and "no tool 'multiply'" in errors[1] and "TypeError" in errors[2]
    assert "not JSON" in errors[3] and "needs" in errors[4] and "not closed" in errors[5]
    ok = runner.run(
        [
            (
                {"divide": divide},
                parse_tool_calls('<tool_call>{"name": "divide", "arguments": {"a": 6, "b": 3}}</tool_call>'),
            )
        ]
    )
    assert ok == [[({"role": "tool", "name": "divide", "content": "2.0"}, False)]]


def test_async_tools_run_concurrently_on_a_private_loop_even_inside_a_running_one():
    started = []

    async def search(query: str) -> str:
        """Search.

        Args:
            query: the query
        """
        started.append(query)
        await asyncio.sleep(0.05)
        return f"{query}: {len(started)} started"

    calls = [
        parse_tool_calls(f'<tool_call>{{"name": "search", "arguments": {{"query": "{q}"}}}}</tool_call>') for q in "ab"
    ]

    async def inside_a_running_loop():  # e.g. Jupyter's
        return ToolRunner().run([({"search": search}, c) for c in calls])

    results = asyncio.run(inside_a_running_loop())
    assert [r[0][0]["content"] for r in results] == ["a: 2 started", "b: 2 started"]  # both began before either ended


# ---- Qwen 2.5's real template and trl's parser --------------------------------------------------------------------------


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def test_on_qwen_2_5s_template_calls_are_parsed_by_trls_response_template_and_results_follow_its_format():
    tokenizer = qwen_style_tokenizer()
    parse = tool_call_parser(tokenizer)
    assert tokenizer.response_template is not None  # set by trl's add_response_schema
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": "4"}}\n</tool_call><|im_end|>'
    message, (parsed,) = parse(tokenizer(call, add_special_tokens=False)["input_ids"], [], [tool_schema(multiply)])
    assert message["tool_calls"][0]["function"]["name"] == "multiply"  # TRL's completions entry
    assert (parsed.name, parsed.arguments) == ("multiply", {"a": 3, "b": 4})  # cast by the schema

    def write(context: str) -> str:
        return "It is 12.<|im_end|>" if "<tool_response>" in context else call

    rows = {"question": ["3 × 4?"]}
    out, _, policy, _ = run_agent(write, tools=[multiply], rows=rows, tokenizer=tokenizer, response_length=256)
    inserted = tokenizer.decode(out.response_ids[0][(out.env_mask[0] == 0) & out.response_mask[0].bool()])
    assert inserted == "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(out.response_ids[0][out.env_mask[0].bool()]) == call + "It is 12.<|im_end|>"
    assert '"name": "multiply"' in policy.contexts[0]  # the tools' schemas in the system prompt


def test_templates_that_cannot_carry_tool_results_are_refused_and_everyday_ones_pass():
    tokenizer = agent_tokenizer()
    with pytest.raises(ValueError, match="end an assistant turn with the stop token"):
        ToolTurnTokens(tokenizer, tokenizer.convert_tokens_to_ids("user:"))
    silent = agent_tokenizer()
    silent.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['content'] }} </s> {% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="does not render"):
        ToolTurnTokens(silent, silent.eos_token_id)
    from trl_ppomax.toyworld.tiny import build_tokenizer

    for everyday in (agent_tokenizer(), build_tokenizer(), qwen_style_tokenizer()):  # the toy, the tiny, Qwen 2.5
        assert ToolTurnTokens(everyday, everyday.eos_token_id)([{"role": "tool", "name": "f", "content": "x"}])


def test_bad_tools_and_environments_are_refused_with_the_fix():
    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ValueError, match=r"'undocumented' cannot be described.*Google-style docstring"):
        run_agent(call_then_answer, tools=[undocumented])

    class NoReset:
        def lookup(self) -> str:
            """Look up."""
            return "cat"

    with pytest.raises(ValueError, match="without a reset\\(\\) method"):
        run_agent(call_then_answer, environment=NoReset)

    class NoTools:  # TRL's contract allows it: one turn per trajectory, nothing parsed as a call
        def reset(self, **row):
            return " dog"

    out, _, policy, _ = run_agent(call_then_answer, environment=NoTools)
    assert len(policy.contexts) == 1 and out.env_mask[0].all() and "secret topic dog" in policy.contexts[0]


# ---- training runs on a tiny SFT agent --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_agent(tmp_path_factory):
    """A tiny SFT agent as trl's SFTTrainer saves it (tokenizer beside the weights): it calls ``lookup`` most of the
    time."""
    settings = AgentSettings(hidden_size=32, sft_dialogues=600, sft_epochs=3, p_tool=0.8)
    return prepare_agent_policy(settings, cache_dir=tmp_path_factory.mktemp("agents"))


RUN = dict(
    per_device_train_batch_size=4, gradient_accumulation_steps=1, num_mini_batches=1, total_episodes=8,
    response_length=24, max_completion_tokens=40, num_ppo_epochs=1, learning_rate=1e-3, stop_token="eos",
    report_to="none", num_sample_generations=0, logging_steps=1, save_strategy="no", critic_warmup_steps=0, seed=0,
    use_cpu=True, disable_tqdm=True, gradient_checkpointing=False,
)  # fmt: skip


def agent_trainer(sft: str, tmp_path, reward=agent_gold_reward, **kwargs) -> PPOMaxTrainer:
    settings = {**RUN, **kwargs.pop("settings", {})}
    return PPOMaxTrainer(
        args=PPOMaxConfig(output_dir=str(tmp_path / "out"), **settings),
        processing_class=AutoTokenizer.from_pretrained(sft),
        model=AutoModelForCausalLM.from_pretrained(sft),
        ref_model=None,
        reward_model=reward,
        train_dataset=agent_prompts(16),
        value_model=AutoModelForSequenceClassification.from_pretrained(sft, num_labels=1),
        **kwargs,
    )


def first_rollout(trainer, topic: str):
    """The greedy rollout of the first training batch (the SFT agent calls the tool), every secret topic ``topic``."""
    batch, columns = data.split_batch(trainer.prompt_batches[0], trainer.accelerator.device)
    columns["topic"] = [topic] * len(columns["topic"])
    return trainer.rollout(batch["input_ids"], batch["attention_mask"], sampling=False, columns=columns)


def trains_and_logs(trainer) -> list[dict]:
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    before = snapshot(policy)
    trainer.train()
    assert changed(before, policy) > 0
    return [entry for entry in trainer.state.log_history if M.TOOL_CALL_FREQUENCY in entry]


def test_a_tool_calling_run_trains_and_logs_the_tool_metrics(sft_agent, tmp_path):
    def lookup() -> str:
        """Look up the secret topic the user is asking about."""
        return "cat"

    logs = trains_and_logs(agent_trainer(sft_agent, tmp_path, tools=[lookup]))
    assert len(logs) == 2 and all(entry[M.TOOL_TURNS] > 0 for entry in logs)  # calls run, well-formed or not
    assert all(0 <= entry[M.TOOL_FAILURE_RATE] <= 1 for entry in logs)  # a malformed sampled call: logged, not raised
    assert all(0 <= entry[M.TOOL_FAILURE_FREQUENCY] <= 1 for entry in logs)  # TRL's, of the well-formed calls
    assert all(entry[M.RESPONSE_LENGTH] <= 24 for entry in logs)  # the policy's tokens


def test_an_environment_run_trains_with_the_environments_reward_and_its_tools(sft_agent, tmp_path):
    class CountingLookup(LookupEnvironment):
        def reset(self, topic: str, **row) -> str:
            super().reset(topic)
            self.calls = 0
            return ""

        def lookup(self) -> str:
            """Look up the secret topic the user is asking about."""
            self.calls += 1
            return self.topic

        def get_reward(self) -> float:
            return float(self.calls == 1)

    trainer = agent_trainer(sft_agent, tmp_path, reward=None, environment_factory=CountingLookup)
    assert isinstance(trainer.reward_sources.sources[-1], EnvironmentReward)
    logs = trains_and_logs(trainer)
    assert all("rewards/CountingLookup/mean" in entry for entry in logs) and any(e[M.TOOL_TURNS] > 0 for e in logs)
    rollout = first_rollout(trainer, topic="dog")
    inserted = rollout.response_mask.bool() & (rollout.env_mask == 0)
    assert inserted.any() and (rollout.policy_mask[inserted] == 0).all()
    assert "dog" in trainer.processing_class.decode(rollout.response_ids[inserted])  # what the environment said


def test_training_on_tool_tokens_is_an_ablation_that_drops_the_mask(sft_agent, tmp_path):
    trainer = agent_trainer(
        sft_agent, tmp_path, environment_factory=LookupEnvironment, settings={"train_on_env_tokens": True}
    )
    rollout = first_rollout(trainer, topic="dog")
    assert rollout.env_mask is None and torch.equal(rollout.policy_mask, rollout.response_mask)


def test_agent_settings_that_cannot_work_are_refused_and_everyday_ones_pass(sft_agent, tmp_path):
    with pytest.raises(ValueError, match="max_staleness=0 with tools"):
        agent_trainer(sft_agent, tmp_path, environment_factory=LookupEnvironment, settings={"max_staleness": 1})
    with pytest.raises(ValueError, match="cannot be combined with tools"):
        agent_trainer(sft_agent, tmp_path, environment_factory=LookupEnvironment, rollout_func=lambda p, t: {})
    with pytest.raises(ValueError, match=r"reward_model is None.*get_reward"):
        agent_trainer(sft_agent, tmp_path, reward=None, environment_factory=LookupEnvironment)
    with pytest.raises(TypeError, match="tools must be a list of functions"):
        agent_trainer(sft_agent, tmp_path, tools="lookup")
    assert agent_trainer(sft_agent, tmp_path, environment_factory=LookupEnvironment).agent is not None


def test_the_agent_tasks_gold_reward_reads_the_final_answer_against_the_secret_topic():
    trajectory = f"{TOOL_CALL} </s> tool: dog </s> assistant: please the dog is nice </s>"
    assert final_answer(trajectory) == "please the dog is nice </s>"
    assert agent_gold_reward(None, [trajectory, "please the cat is nice </s>"], ["dog", "dog"]) == [1.5, 0.0]


@pytest.mark.slow  # two small toy-world agent runs in their own processes (.ci/run runs it)
def test_the_agent_example_script_and_benchmark_run(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRL_PPOMAX_CACHE": str(tmp_path / "cache")}
    example = [
        sys.executable,
        str(root / "examples/ppo_max_agent.py"),
        "--quick",
        "--output-dir",
        str(tmp_path / "ex"),
    ]
    out = subprocess.run(example, env=env, capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert "gold reward:" in out and "tool-call rate:" in out
    output = tmp_path / "agent.json"
    benchmark = [sys.executable, str(root / "benchmarks/agent.py"), "--small", "--iterations", "2", "--seed", "0"]
    subprocess.run([*benchmark, "--output", str(output)], env=env, check=True, cwd=tmp_path, capture_output=True)
    results = json.loads(output.read_text())
    assert set(results["conditions"]) == {"tool", "no_tool", "tool_train_on_env_tokens", "tool_grpo"}
    for condition in results["conditions"].values():
        assert len(condition["curves"]["gold_reward"]) == 2 and 0 <= condition["tool_call_rate_final"] <= 1
    assert len((tmp_path / "agent.runs.jsonl").read_text().splitlines()) == 4


# ---- round four: tool faults are failures, timeouts, one name per tool, threads closed, environment checks -----------
def tool_calls(name: str, count: int = 1) -> list:
    return parse_tool_calls(f'<tool_call>{{"name": "{name}", "arguments": {{}}}}</tool_call>' * count)


def test_a_tool_raising_system_exit_is_a_failure_and_keyboard_interrupt_stops_the_run():
    """argparse inside a tool exits with SystemExit(2): the policy reads it, the run goes on. Ctrl-C still stops."""

    def cli_tool() -> str:
        """Run a command line."""
        raise SystemExit(2)

    async def async_cli_tool() -> str:
        """Run a command line, asynchronously."""
        raise SystemExit(2)

    def interrupted() -> str:
        """Interrupted by the user."""
        raise KeyboardInterrupt

    runner = ToolRunner()
    tools = {"cli_tool": cli_tool, "async_cli_tool": async_cli_tool, "interrupted": interrupted}
    results = runner.run([(tools, tool_calls("cli_tool")), (tools, tool_calls("async_cli_tool"))])
    assert [r[0][1] for r in results] == [True, True]
    assert all("SystemExit: 2" in r[0][0]["content"] for r in results)
    assert runner.run([(tools, tool_calls("async_cli_tool"))])[0][0][1]  # the loop's thread survived
    with pytest.raises(KeyboardInterrupt):
        runner.run([(tools, tool_calls("interrupted"))])
    runner.close()


def test_tool_timeout_makes_a_slow_call_a_failure_and_fast_ones_pass():
    import time

    def slow() -> str:
        """Take a long time."""
        time.sleep(3)
        return "late"

    async def slow_async() -> str:
        """Take a long time, asynchronously."""
        await asyncio.sleep(3)
        return "late"

    def fast() -> str:
        """Answer at once."""
        return "now"

    runner = ToolRunner(timeout=0.2)
    tools = {"slow": slow, "slow_async": slow_async, "fast": fast}
    begun = time.perf_counter()
    results = runner.run([(tools, tool_calls("slow")), (tools, tool_calls("slow_async")), (tools, tool_calls("fast"))])
    assert time.perf_counter() - begun < 2.5
    assert [r[0][1] for r in results] == [True, True, False] and results[2][0][0]["content"] == "now"
    assert all("ran past tool_timeout=0.2 s" in r[0][0]["content"] for r in results[:2])
    runner.close()
    assert ToolRunner().timeout is None and agent_args().tool_timeout is None  # the default waits
    with pytest.raises(ValueError, match="tool_timeout"):
        agent_args(tool_timeout=0)


def test_close_stops_the_async_tools_thread_and_a_later_run_starts_it_again():
    import threading

    async def ping() -> str:
        """Ping."""
        return "pong"

    def loop_threads() -> int:
        return sum(t.name == "trl-ppomax-tools" and t.is_alive() for t in threading.enumerate())

    runner, before = ToolRunner(), loop_threads()
    runner.run([({"ping": ping}, tool_calls("ping"))])
    assert loop_threads() == before + 1
    runner.close()
    assert loop_threads() == before
    assert runner.run([({"ping": ping}, tool_calls("ping"))])[0][0][0]["content"] == "pong"
    runner.close()


def test_two_tools_with_one_name_are_refused_and_distinct_names_pass():
    def lookup() -> str:
        """Look up."""
        return "cat"

    def other() -> str:
        """Look up elsewhere."""
        return "dog"

    other.__name__ = "lookup"
    with pytest.raises(ValueError, match="Two tools are named 'lookup' in the tools"):
        run_agent(call_then_answer, tools=[lookup, other])
    with pytest.raises(ValueError, match="Two tools are named 'lookup' in the tools and LookupEnvironment's methods"):
        run_agent(call_then_answer, tools=[lookup], environment=LookupEnvironment)
    other.__name__ = "other"
    run_agent(call_then_answer, tools=[lookup, other])


def test_an_async_reset_is_refused_at_construction():
    class AsyncReset(LookupEnvironment):
        async def reset(self, **row):
            return ""

    with pytest.raises(TypeError, match=r"AsyncReset\.reset is async def.*plain def"):
        run_agent(call_then_answer, environment=AsyncReset)
    run_agent(call_then_answer, environment=LookupEnvironment)  # the everyday environment


def test_get_reward_results_are_validated():
    import numpy as np

    reward = EnvironmentReward(LookupEnvironment)
    assert (
        reward.reward_value(1) == 1.0
        and reward.reward_value(True) == 1.0
        and reward.reward_value(np.float32(0.5)) == 0.5
    )
    assert reward.reward_value(torch.tensor([2.0])) == 2.0 and reward.reward_value(None) is None
    for bad in ("0.5", [1.0], {"score": 1}):
        with pytest.raises(TypeError, match=r"LookupEnvironment.get_reward\(\) returned .*must return a number"):
            reward.reward_value(bad)


def test_a_trajectory_never_grows_past_the_policys_context():
    """With a 20-token context (the whole trajectory takes 29) the trajectory stops where the context ends."""
    tokenizer = agent_tokenizer()
    args = agent_args(response_length=24)
    agent = AgentRollouts(args, tokenizer, [], LookupEnvironment, tokenizer.eos_token_id, context_length=20)
    out = agent.generate(
        ScriptedPolicy(tokenizer, call_then_answer), [CONVERSATION], {"topic": ["dog"]}, True, 1,
        tokenizer.pad_token_id, "cpu",
    )  # fmt: skip
    assert int(out.query_mask.sum() + out.response_mask.sum()) == 20
    unbounded, *_ = run_agent(call_then_answer, environment=LookupEnvironment)
    assert int(unbounded.query_mask.sum() + unbounded.response_mask.sum()) > 20  # the bound acted


def test_a_chat_template_without_a_tools_block_is_warned_about(caplog):
    def lookup() -> str:
        """Look up the secret topic."""
        return "cat"

    with caplog.at_level("WARNING", logger="trl_ppomax.generation.agent"):
        run_agent(call_then_answer, tools=[lookup])
    assert caplog.text == ""  # the toy agent template shows its tools
    tokenizer = agent_tokenizer()
    tokenizer.chat_template = tokenizer.chat_template.replace("tools", "no_tools_here")
    with caplog.at_level("WARNING", logger="trl_ppomax.generation.agent"):
        AgentRollouts(agent_args(), tokenizer, [lookup], None, tokenizer.eos_token_id)
    assert "renders none of the tools ['lookup']" in caplog.text


def test_agent_settings_without_an_agent_are_named(tmp_path, caplog):
    from helpers import make_trainer

    with caplog.at_level("WARNING", logger="trl_ppomax.ppo.setup"):
        make_trainer(tmp_path, max_tool_turns=2, tool_timeout=5.0)
    assert "max_tool_turns=2, tool_timeout=5.0: not applied, the run has no agent loop" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="trl_ppomax.ppo.setup"):
        make_trainer(tmp_path)
    assert "no agent loop" not in caplog.text


def test_training_with_async_tools_leaves_no_tool_thread_alive(sft_agent, tmp_path):
    import threading

    async def lookup() -> str:
        """Look up the secret topic the user is asking about."""
        return "cat"

    def loop_threads() -> set:
        return {t for t in threading.enumerate() if t.name == "trl-ppomax-tools" and t.is_alive()}

    before = loop_threads()
    trainer = agent_trainer(sft_agent, tmp_path, tools=[lookup], settings={"tool_timeout": 30.0})
    logs = trains_and_logs(trainer)
    assert logs and all(entry[M.TOOL_TURNS] > 0 for entry in logs)  # the async tool was called
    assert loop_threads() <= before  # train() closed the loop it started
