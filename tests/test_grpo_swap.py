"""TRL's GRPO scripts on PPOMaxTrainer (every ``trl.GRPOConfig`` field, taken with TRL's meaning or refused by name:
``test_ppo_grpo_names.py``): GRPOTrainer's keyword form (the model as a folder, the tokenizer loaded beside it, no value
model), ``max_steps``, and TRL's own agent tests (``tests/test_grpo_trainer.py``: tools, environments, environment-owned
rewards and data, several environments, ``rollout_func``) ported with the import swapped. Stand-ins for the Hub's tiny
models: a Qwen 2.5-shaped folder (:func:`user_setups.write_qwen_instruct_folder`) and a sequence classifier built from
it; the scripted completions are TRL's strings, encoded by the stand-in tokenizer (the Hub tokenizer's ids cannot be
downloaded)."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from user_setups import write_qwen_instruct_folder

from trl_ppomax import PPOMaxConfig as GRPOConfig
from trl_ppomax import PPOMaxTrainer as GRPOTrainer
from trl_ppomax import data
from trl_ppomax.base import metrics as M

trl = pytest.importorskip("trl")


# ---- GRPOTrainer's keyword form, trained -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Local stand-ins for trl-internal-testing's tiny Qwen causal LM and Qwen2 sequence classifier."""
    root = tmp_path_factory.mktemp("hub")
    policy = write_qwen_instruct_folder(root / "tiny-Qwen2.5")
    scorer = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1)
    scorer.config.pad_token_id = AutoTokenizer.from_pretrained(policy).pad_token_id
    scorer.save_pretrained(root / "tiny-Qwen2ForSequenceClassification")
    AutoTokenizer.from_pretrained(policy).save_pretrained(root / "tiny-Qwen2ForSequenceClassification")
    return {"policy": str(policy), "scorer": str(root / "tiny-Qwen2ForSequenceClassification")}


def conversational_prompts(n: int = 2) -> Dataset:
    """Shaped like trl-internal-testing/zen's conversational_prompt_only."""
    questions = ["Beautiful is better than", "Explicit is", "Simple is better than", "Flat is better than"]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": questions[i % 4]}] for i in range(n)]})


def swap_args(tmp_path, **overrides) -> GRPOConfig:
    """TRL's test settings, as its tests write them; max_completion_length 512, not 128: the stand-in tokenizer is
    byte-level, a tool call 80 tokens where Qwen's is 26."""
    settings = dict(
        output_dir=str(tmp_path), learning_rate=0.1, per_device_train_batch_size=3, num_generations=3,
        max_completion_length=512, report_to="none", use_cpu=True,
    )  # fmt: skip
    return GRPOConfig(**{**settings, **overrides})


def scripted(tokenizer, first: list[str], then: list[str]):
    """TRL's ``fake_generate``: a call on as many rows as ``first`` (every trajectory's first turn) writes ``first``,
    others ``then``; the texts encoded by the stand-in tokenizer, right-padded with its pad token."""
    calls = []

    def fake_generate(input_ids, **kwargs):
        texts = first if input_ids.shape[0] == len(first) else then
        calls.append(input_ids.shape[0])
        rows = [tokenizer(texts[i % len(texts)], add_special_tokens=False)["input_ids"] for i in range(len(input_ids))]
        width = max(map(len, rows))
        padded = [row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows]
        return torch.cat([input_ids, torch.tensor(padded, device=input_ids.device)], dim=-1)

    return fake_generate, calls


def written_by(tokenizer, write):
    """A ``generate`` whose row writes ``write(its context text)``: the policy of a scripted agent."""

    def fake_generate(input_ids, **kwargs):
        rows = [tokenizer(write(tokenizer.decode(row)), add_special_tokens=False)["input_ids"] for row in input_ids]
        width = max(map(len, rows))
        padded = [row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows]
        return torch.cat([input_ids, torch.tensor(padded, device=input_ids.device)], dim=-1)

    return fake_generate


def call_then(call: str, answer: str = "Done!<|im_end|>"):
    return lambda context: answer if "<tool_response>" in context else call


def multiply_tool(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_multiply_tool(a: int, b: int) -> int:
    """
    Asynchronously multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def every_parameter_changed(before: dict, model) -> None:
    for name, param in before.items():
        assert not torch.equal(param, model.get_parameter(name)), f"Parameter {name} has not changed."


@pytest.mark.slow  # 18 iterations, as TRL's test trains (the default suite keeps the one-iteration tool runs below)
@pytest.mark.parametrize("tools", [[multiply_tool], [async_multiply_tool]], ids=["sync", "async"])
def test_train_with_tools(hub, tmp_path, tools):
    """TRL's test_train_with_tools: 3 completions, 2 well-formed calls (one fails: a wrong argument name), one plain
    answer; the stop settings left alone (stop_token=None): turns still end at <|im_end|>, so the tools run."""
    name = tools[0].__name__
    trainer = GRPOTrainer(
        model=hub["policy"], reward_funcs=hub["scorer"], args=swap_args(tmp_path), train_dataset=conversational_prompts(),
        tools=tools,
    )  # fmt: skip
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
    first = [
        f'<tool_call>\n{{"name": "{name}", "arguments": {{"a": 3, "b": 4}}}}\n</tool_call><|im_end|>',
        f'<tool_call>\n{{"name": "{name}", "arguments": {{"a": 3, "c": 4}}}}\n</tool_call><|im_end|>',
        "I don't know any tool<|im_end|>",
    ]
    fake_generate, calls = scripted(trainer.processing_class, first, ["Done!<|im_end|>"])
    with patch.object(trainer.model, "generate", side_effect=fake_generate):
        trainer.train()
    assert calls[:2] == [3, 2]  # the second turn: only the two trajectories that called
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert trainer.state.log_history[-1]["tools/call_frequency"] == pytest.approx(2 / 3)
    assert trainer.state.log_history[-1]["tools/failure_frequency"] == pytest.approx(1 / 2)
    every_parameter_changed(previous_trainable_params, trainer.model)


def recording(seen: list):
    def reward(completions, **kwargs):
        seen.extend(completions)
        return [float(len(str(c))) for c in completions]

    return reward


def test_reward_functions_get_trls_completions_the_trajectorys_messages(hub, tmp_path):
    seen: list = []
    trainer = GRPOTrainer(
        model=hub["policy"], reward_funcs=recording(seen), args=swap_args(tmp_path, max_steps=1),
        train_dataset=conversational_prompts(), tools=[multiply_tool],
    )  # fmt: skip
    call = '<tool_call>\n{"name": "multiply_tool", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'
    fake_generate = written_by(trainer.processing_class, call_then(call, "It is 12.<|im_end|>"))
    with patch.object(trainer.model, "generate", side_effect=fake_generate):
        trainer.train()
    trajectory = seen[0]
    assert [m["role"] for m in trajectory] == ["assistant", "tool", "assistant"]
    assert trajectory[0]["tool_calls"][0]["function"] == {"name": "multiply_tool", "arguments": {"a": 3, "b": 4}}
    assert trajectory[1] == {"role": "tool", "name": "multiply_tool", "content": "12"}
    assert trajectory[-1]["content"] == "It is 12."  # the policy's last words, not the tool's


class IncrementEnvironment:
    def reset(self, **kwargs):
        self._counter = 0

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self._counter += step
        return self._counter


class CounterEnvironment(IncrementEnvironment):
    """TRL's counter, owning its reward: the count."""

    def get_reward(self) -> float:
        return float(self._counter)


def test_train_with_environment_owned_reward_and_data(hub, tmp_path):
    """TRL's test_train_with_environment_owned_reward and _owned_data: no reward_funcs, no train_dataset; reset()
    writes the prompt and get_reward() scores; max_steps sets the length."""

    class Owned(CounterEnvironment):
        def reset(self, **kwargs) -> str:
            self._counter = 0
            return "Count up."

    trainer = GRPOTrainer(
        model=hub["policy"], reward_funcs=None, args=swap_args(tmp_path, max_steps=2), environment_factory=Owned
    )
    call = '<tool_call>\n{"name": "increment", "arguments": {"step": 2}}\n</tool_call><|im_end|>'
    fake_generate = written_by(trainer.processing_class, call_then(call))
    with patch.object(trainer.model, "generate", side_effect=fake_generate):
        trainer.train()
    assert trainer.state.global_step == 2 and trainer.state.log_history[-1]["train_loss"] is not None
    logged = trainer.state.log_history[-1]
    for trl_name, ours in M.TRL_NAMES.items():  # TRL's names beside ours
        assert logged[trl_name] == logged[ours], trl_name
    assert trainer.state.log_history[-1]["rewards/Owned/mean"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="set max_steps"):
        GRPOTrainer(model=hub["policy"], reward_funcs=None, args=swap_args(tmp_path), environment_factory=Owned)


@pytest.mark.slow  # seconds (the README's command stays under 4 minutes; .ci/run runs it)
def test_train_with_multiple_environments(hub, tmp_path):
    """TRL's test_train_with_multiple_environments: a dict of environments, each row's ``environment`` column picks
    one; only its tools are shown and called."""

    class EchoEnvironment:
        def reset(self, **kwargs) -> str | None:
            self.said = ""
            return None

        def shout(self, text: str) -> str:
            """
            Shout a text.

            Args:
                text: What to shout.

            Returns:
                The text in capitals.
            """
            self.said = text.upper()
            return self.said

    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": "Go."}]] * 4, "environment": ["counter", "echo"] * 2}
    )
    seen: list = []
    trainer = GRPOTrainer(
        model=hub["policy"], reward_funcs=recording(seen), args=swap_args(tmp_path, per_device_train_batch_size=12, max_steps=1),
        train_dataset=dataset, environment_factory={"counter": CounterEnvironment, "echo": EchoEnvironment},
    )  # fmt: skip
    calls = {
        "counter": '<tool_call>\n{"name": "increment", "arguments": {"step": 1}}\n</tool_call><|im_end|>',
        "echo": '<tool_call>\n{"name": "shout", "arguments": {"text": "hi"}}\n</tool_call><|im_end|>',
    }

    def write(context: str) -> str:  # each row calls its own environment's tool (the schema in its prompt)
        return call_then(calls["echo" if '"shout"' in context else "counter"])(context)

    fake_generate = written_by(trainer.processing_class, write)
    with patch.object(trainer.model, "generate", side_effect=fake_generate):
        trainer.train()
    tools_results = [m["content"] for trajectory in seen for m in trajectory if m["role"] == "tool"]
    assert "1" in tools_results and "HI" in tools_results  # each environment's tool ran, none failed
    assert trainer.state.log_history[-1]["tools/failure_frequency"] == 0.0
    bad = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Go."}]] * 3, "environment": ["nope"] * 3})
    trainer = GRPOTrainer(
        model=hub["policy"], reward_funcs=recording([]), args=swap_args(tmp_path / "bad", max_steps=1),
        train_dataset=bad, environment_factory={"counter": CounterEnvironment},
    )  # fmt: skip
    with pytest.raises(ValueError, match="'nope', which is not among the environments"):
        trainer.train()


def test_rollout_func_gets_each_prompt_num_generations_times(hub, tmp_path):
    """TRL's rollout_func contract: the prompts repeated ``num_generations`` times, one completion per prompt given."""
    given: list = []

    def rollout_func(prompts, trainer):
        given.extend(prompts)
        tokenizer = trainer.processing_class
        texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
        ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        completion = tokenizer("Done!<|im_end|>", add_special_tokens=False)["input_ids"]
        return {"prompt_ids": ids, "completion_ids": [completion] * len(prompts),
                "logprobs": [[0.0] * len(completion)] * len(prompts)}  # fmt: skip

    trainer = GRPOTrainer(
        model=hub["policy"], reward_funcs=recording([]), args=swap_args(tmp_path, max_steps=1),
        train_dataset=conversational_prompts(), rollout_func=rollout_func,
    )  # fmt: skip
    trainer.train()
    assert len(given) == 3 and given[0] == given[1] == given[2]  # one prompt, three generations


@pytest.mark.slow  # critic warm-up and training: seconds
def test_a_swapped_script_is_told_what_it_runs(hub, tmp_path, caplog):
    trainer = GRPOTrainer(
        model=hub["policy"], reward_funcs=recording([]), args=swap_args(tmp_path, max_steps=1),
        train_dataset=conversational_prompts(),
    )  # fmt: skip
    with caplog.at_level("WARNING"):
        trainer.train()
    assert "runs PPO-max (a critic, GAE" in caplog.text and "temperature=0.8 (GRPOConfig: 1.0)" in caplog.text
    assert trainer.model.critic is not None  # the policy with a fresh scalar head: no reward model to start it from


# ---- the same trajectories, the same completions under both trainers ---------------------------------------------------
def lookup_rows(sql_command: str) -> list:
    """
    Run a read-only SQL query on the interactions table.

    Args:
        sql_command: The SQL query.

    Returns:
        The matching rows.
    """
    return [("BRCA1", "BARD1")] if "where" in sql_command.lower() else []


def evidence_reward(completions, answer, **kwargs):
    """Shaped like grpo_agent.py's query and structure rewards: reads the calls' arguments, the tools' results (a list
    of rows is evidence) and the last message's content."""
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        queries = [
            call["function"]["arguments"]["sql_command"]
            for turn in completion
            for call in turn.get("tool_calls") or []
        ]
        rows = [
            row
            for turn in completion
            if turn["role"] == "tool" and isinstance(turn["content"], list)
            for row in turn["content"]
        ]
        final = completion[-1]["content"].lower()
        scores.append(0.4 * sum(" where " in q.lower() for q in queries) + (2.0 if bool(rows) == (expected == "yes") else -1.5)
                      + (0.6 if f"*{expected}*" in final else -0.5))  # fmt: skip
    return scores


def test_the_same_trajectories_give_trls_completions_and_scores(hub, tmp_path):
    """TRL's GRPOTrainer and ours on the same scripted agent (a call, the tool's rows, an answer): the reward functions
    get equal ``completions`` (assistant messages with ``tool_calls``, ``role: "tool"`` messages, the tool's list
    kept) and so give equal scores."""
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Do BRCA1 and BARD1 interact?"}]] * 2,
                                 "answer": ["yes", "no"]})  # fmt: skip
    calls = ['<tool_call>\n{"name": "lookup_rows", "arguments": {"sql_command": "SELECT * FROM t WHERE a = 1"}}\n'
             "</tool_call><|im_end|>", "They interact: *yes*<|im_end|>", "*no*<|im_end|>"]  # fmt: skip
    write = lambda context: calls[1] if "<tool_response>" in context else calls[0]  # noqa: E731
    seen = {"trl": [], "ours": []}
    scored = {"trl": [], "ours": []}

    def reward_for(name):
        def reward(completions, answer, **kwargs):
            seen[name].extend(completions)
            scored[name].extend(evidence_reward(completions, answer))
            return scored[name][-len(completions) :]

        return reward

    args = dict(per_device_train_batch_size=3, num_generations=3, max_completion_length=512, report_to="none",
                use_cpu=True, bf16=False, shuffle_dataset=False)  # fmt: skip
    theirs = trl.GRPOTrainer(
        model=hub["policy"], reward_funcs=reward_for("trl"), train_dataset=dataset, tools=[lookup_rows],
        args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), **args),
    )  # fmt: skip
    with patch.object(theirs.model, "generate", side_effect=written_by(theirs.processing_class, write)):
        theirs.model.train()
        theirs._prepare_inputs([dataset[0]] * 3)
    ours = GRPOTrainer(
        model=hub["policy"], reward_funcs=reward_for("ours"), train_dataset=dataset, tools=[lookup_rows],
        args=GRPOConfig(output_dir=str(tmp_path / "ours"), **args),
    )  # fmt: skip
    tensors, columns = data.split_batch(data.PromptCollator(0)([ours.train_dataset[0]]), "cpu")  # TRL's row
    with patch.object(ours.model, "generate", side_effect=written_by(ours.processing_class, write)):
        ours.rollout(tensors["input_ids"], tensors["attention_mask"], True, columns, 3)
    assert seen["ours"] == seen["trl"] and len(seen["ours"]) == 3
    assert seen["ours"][0][1]["content"] == [("BRCA1", "BARD1")]  # the tool's rows, a list as TRL keeps it
    assert scored["ours"] == scored["trl"]


def test_mask_truncated_completions_leaves_cut_responses_out_of_the_losses_only(tmp_path):
    from helpers import make_trainer

    from trl_ppomax.base import core

    for masked in (True, False):
        trainer = make_trainer(
            tmp_path / str(masked), stop_token="eos", response_length=3, mask_truncated_completions=masked
        )
        batch, columns = data.split_batch(trainer.prompt_batches[0], "cpu")
        rollout = trainer.rollout(batch["input_ids"], batch["attention_mask"], True, columns)
        experience, _, _ = trainer.make_experience(rollout)
        last = rollout.response_ids.gather(1, core.last_token_index(rollout.response_mask)[:, None])[:, 0]
        cut = last != trainer.processing_class.eos_token_id
        kept = experience.rollout.policy_mask.sum(1) > 0
        assert kept.tolist() == (~cut if masked else torch.ones_like(cut)).tolist()
        assert torch.equal(experience.rollout.scores, rollout.scores)  # the scores still count, as in TRL


class ScriptedTurns:
    """``prefix_allowed_tokens_fn`` allowing one token: the next of a call, or, after the tool's result, of an answer
    (module-level, so that the config holding it can be saved with a checkpoint)."""

    CALL = '<tool_call>\n{"name": "multiply_tool", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        self.scripts = {False: encode(self.CALL), True: encode("It is 12.<|im_end|>")}
        self.header = encode("<|im_start|>assistant\n")

    def __call__(self, batch_id: int, input_ids) -> list[int]:
        ids, width = input_ids.tolist(), len(self.header)
        start = max(i + width for i in range(len(ids) - width + 1) if ids[i : i + width] == self.header)
        script = self.scripts["<tool_response>" in self.tokenizer.decode(ids)]
        written = len(ids) - start
        return [script[written]] if written < len(script) else [self.tokenizer.eos_token_id]


@pytest.mark.slow  # the real generate, token by token
def test_a_tools_run_with_the_default_stop_settings_calls_its_tools(hub, tmp_path):
    """The real ``generate`` (sampling, the engine's stop token) scripted by ``prefix_allowed_tokens_fn`` (TRL's
    ``generation_kwargs``), on a tokenizer whose eos is not the end of turn (Qwen's base ``<|endoftext|>``), the stop
    settings left alone (a GRPO script's: completions end at eos): each turn still ends at ``<|im_end|>``, so the
    call runs and the answer follows."""
    tokenizer = AutoTokenizer.from_pretrained(hub["policy"])
    tokenizer.eos_token = "<|endoftext|>"  # eos ≠ end of turn, as Qwen's base models
    next_token = ScriptedTurns(tokenizer)
    with pytest.raises(ValueError, match=r"generation_kwargs=.* cannot be saved with the checkpoints"):
        GRPOConfig(output_dir=str(tmp_path), generation_kwargs={"prefix_allowed_tokens_fn": lambda b, ids: [0]})
    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, total_episodes=2, response_length=128,
        report_to="none", use_cpu=True, num_sample_generations=0, generation_kwargs={"prefix_allowed_tokens_fn": next_token},
    )  # fmt: skip
    assert args.stop_token_id is None
    trainer = GRPOTrainer(
        args=args, processing_class=tokenizer, model=hub["policy"], reward_funcs=recording([]),
        train_dataset=conversational_prompts(), tools=[multiply_tool],
    )  # fmt: skip
    trainer.train()
    logged = trainer.state.log_history[-1]
    assert logged["tools/call_frequency"] == 1.0 and logged["tools/failure_frequency"] == 0.0


# ---- TRL's refusals, ported (its messages matched) ---------------------------------------------------------------------
class EnvA:
    def reset(self, **kwargs): ...


class EnvB:
    def reset(self, **kwargs): ...


def test_no_reward_source_raises(hub, tmp_path):
    training_args = GRPOConfig(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer(model=hub["policy"], args=training_args, train_dataset=conversational_prompts())


def test_dataset_required_without_environment(hub, tmp_path):
    training_args = GRPOConfig(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        GRPOTrainer(model=hub["policy"], reward_funcs=hub["scorer"], args=training_args)


def test_environment_owned_data_requires_max_steps(hub, tmp_path):
    class DummyEnvironment:
        def reset(self, **kwargs):
            return "Guess the 5-letter word."

    training_args = GRPOConfig(output_dir=str(tmp_path), report_to="none")  # max_steps unset
    with pytest.raises(ValueError, match="max_steps"):
        GRPOTrainer(
            model=hub["policy"], reward_funcs=hub["scorer"], args=training_args, environment_factory=DummyEnvironment
        )


def test_multiple_environments_without_dataset_raises(hub, tmp_path):
    training_args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, report_to="none")
    with pytest.raises(ValueError, match="requires a `train_dataset`"):
        GRPOTrainer(
            model=hub["policy"], reward_funcs=hub["scorer"], args=training_args,
            environment_factory={"a": EnvA, "b": EnvB},
        )  # fmt: skip


# ---- TRL's reward-function tests, ported (slow: each trains, as TRL's do) ------------------------------------------------
def standard_prompts(n: int = 2) -> Dataset:
    """Shaped like trl-internal-testing/zen's standard_prompt_only."""
    return Dataset.from_dict({"prompt": ["Beautiful is better than", "Explicit is", "Simple is", "Flat is"][:n]})


def reward_args(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path), learning_rate=0.1, per_device_train_batch_size=3, num_generations=3,
                    max_completion_length=8, report_to="none", use_cpu=True)  # fmt: skip
    return GRPOConfig(**{**settings, **overrides})


def trains_every_parameter(trainer) -> dict:
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    every_parameter_changed(previous_trainable_params, trainer.model)
    return trainer.state.log_history[-1]


def longer(completions, **kwargs):
    """Reward function that rewards longer completions."""
    return [float(len(completion)) for completion in completions]


def unique_letters(completions, **kwargs):
    """Reward function that rewards completions with more unique letters."""
    return [float(len(set(completion))) for completion in completions]


@pytest.mark.slow
def test_train_reward_func_standard(hub, tmp_path):
    trainer = GRPOTrainer(model=hub["policy"], reward_funcs=longer, args=reward_args(tmp_path),
                          train_dataset=standard_prompts())  # fmt: skip
    trains_every_parameter(trainer)


@pytest.mark.slow
def test_train_reward_func_conversational(hub, tmp_path):
    def reward_func(completions, **kwargs):
        return [float(len(completion[0]["content"])) for completion in completions]

    trainer = GRPOTrainer(model=hub["policy"], reward_funcs=reward_func, args=reward_args(tmp_path),
                          train_dataset=conversational_prompts())  # fmt: skip
    trains_every_parameter(trainer)


@pytest.mark.slow
def test_train_sync_and_async_reward_funcs_with_weights_and_none_output(hub, tmp_path):
    async def async_longer(completions, **kwargs):
        return [float(len(completion)) for completion in completions]

    def non_applicable_reward_func(completions, **kwargs):
        return [None] * len(completions)

    trainer = GRPOTrainer(
        model=hub["policy"], reward_funcs=[async_longer, unique_letters, non_applicable_reward_func],
        args=reward_args(tmp_path, reward_weights=[0.7, 0.3, 1.0]), train_dataset=standard_prompts(),
    )  # fmt: skip
    logged = trains_every_parameter(trainer)
    for name in ("async_longer", "unique_letters"):
        assert f"rewards/{name}/mean" in logged and f"rewards/{name}/std" in logged


@pytest.mark.slow
def test_train_mixed_reward_funcs_and_an_additional_column(hub, tmp_path):
    def reward_func(completions, some_values, **kwargs):
        """Reward function that rewards completions with lengths closer to the values in some_values."""
        return [
            float(abs(len(completion) - value)) for completion, value in zip(completions, some_values, strict=True)
        ]

    dataset = standard_prompts().add_column("some_values", [2, 3])
    trainer = GRPOTrainer(model=hub["policy"], reward_funcs=[reward_func, hub["scorer"]], args=reward_args(tmp_path),
                          train_dataset=dataset)  # fmt: skip
    trains_every_parameter(trainer)


def test_mismatched_reward_processing_classes_length(hub, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(hub["scorer"])
    with pytest.raises(ValueError, match="must match"):
        GRPOTrainer(
            model=hub["policy"], reward_funcs=[hub["scorer"], hub["scorer"]], args=reward_args(tmp_path),
            train_dataset=standard_prompts(), reward_processing_classes=tokenizer,  # only one, but need two
        )  # fmt: skip


def test_correct_reward_processing_classes_list(hub, tmp_path):
    processing_class1 = AutoTokenizer.from_pretrained(hub["scorer"])
    processing_class2 = AutoTokenizer.from_pretrained(hub["scorer"])
    trainer = GRPOTrainer(
        model=hub["policy"], reward_funcs=[hub["scorer"], hub["scorer"]], args=reward_args(tmp_path),
        train_dataset=standard_prompts(), reward_processing_classes=[processing_class1, processing_class2],
    )  # fmt: skip
    assert len(trainer.reward_processing_classes) == 2


def test_single_reward_model_with_single_processing_class(hub, tmp_path):
    single_processing_class = AutoTokenizer.from_pretrained(hub["scorer"])
    trainer = GRPOTrainer(
        model=hub["policy"], reward_funcs=hub["scorer"], args=reward_args(tmp_path), train_dataset=standard_prompts(),
        reward_processing_classes=single_processing_class,
    )  # fmt: skip
    assert len(trainer.reward_processing_classes) == 1
    assert trainer.reward_processing_classes[0] is single_processing_class


@pytest.mark.slow
def test_reward_metric_reflects_reward_weights(hub, tmp_path):
    """TRL's test (its default multi_objective_aggregation, sum_then_normalize; normalize_then_sum is refused)."""

    def constant_reward_1(completions, **kwargs):
        return [1.0] * len(completions)

    def constant_reward_0(completions, **kwargs):
        return [0.0] * len(completions)

    trainer = GRPOTrainer(
        model=hub["policy"], reward_funcs=[constant_reward_1, constant_reward_0],
        args=reward_args(tmp_path, reward_weights=[0.7, 0.3], max_steps=1), train_dataset=standard_prompts(),
    )  # fmt: skip
    trainer.train()
    assert abs(trainer.state.log_history[-1]["reward"] - 0.7) < 1e-5


def test_reward_functions_get_the_trainer_state_and_log_metric(hub, tmp_path):
    """TRL's test_train_with_reward_func_accessing_trainer_state and _with_log_metric, in one run."""
    steps = []

    def reward_func(completions, **kwargs):
        trainer_state = kwargs.get("trainer_state")
        assert trainer_state is not None and hasattr(trainer_state, "global_step")
        steps.append(trainer_state.global_step)
        kwargs["log_metric"]("custom_accuracy", 0.75)
        return [float(len(set(completion))) for completion in completions]

    def named_only(completions, trainer_state):  # a function naming the keyword gets it too
        return [float(trainer_state.global_step)] * len(completions)

    trainer = GRPOTrainer(
        model=hub["policy"], reward_funcs=[reward_func, named_only], args=reward_args(tmp_path, max_steps=2),
        train_dataset=standard_prompts(),
    )  # fmt: skip
    trainer.train()
    assert steps[0] == 0 and 1 in steps  # the live state: global_step 0 while rollout 1 is scored, 1 for rollout 2
    logged_keys = {k for entry in trainer.state.log_history for k in entry}
    assert "custom_accuracy" in logged_keys and trainer.state.log_history[-1]["custom_accuracy"] == 0.75


@pytest.mark.slow  # 5 iterations, as TRL's test trains
def test_train_with_environment_factory(hub, tmp_path):
    """TRL's test: environment-owned data (reset() returns None: the placeholder prompt), 3 completions, 2 calls of
    which one names a tool that does not exist; each trajectory's environment is in ``trainer.environments``."""
    trainer = GRPOTrainer(
        model=hub["policy"], reward_funcs=hub["scorer"], args=swap_args(tmp_path, max_steps=5),
        environment_factory=IncrementEnvironment,
    )  # fmt: skip
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
    first = [
        '<tool_call>\n{"name": "increment", "arguments": {"step": 1}}\n</tool_call><|im_end|>',
        '<tool_call>\n{"name": "decrement", "arguments": {"step": 2}}\n</tool_call><|im_end|>',
        "I won't increment<|im_end|>",
    ]
    fake_generate, _ = scripted(trainer.processing_class, first, ["Done!<|im_end|>"])
    with patch.object(trainer.model, "generate", side_effect=fake_generate):
        trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert trainer.state.log_history[-1]["tools/call_frequency"] == pytest.approx(2 / 3)
    assert trainer.state.log_history[-1]["tools/failure_frequency"] == pytest.approx(1 / 2)
    assert [environment._counter for environment in trainer.environments] == [1, 0, 0]
    every_parameter_changed(previous_trainable_params, trainer.model)


@pytest.mark.slow  # trains as TRL's test does (the policy after the critic's warm-up)
def test_train_with_malformed_tool_calls(hub, tmp_path):
    """TRL's test: three malformed calls (no name; <toolcall>; unquoted keys): none runs, so no second turn."""
    trainer = GRPOTrainer(
        model=hub["policy"], reward_funcs=hub["scorer"], args=swap_args(tmp_path),
        train_dataset=conversational_prompts(), tools=[multiply_tool],
    )  # fmt: skip
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
    malformed = [
        '<tool_call>\n{"arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
        '<toolcall>\n{"arguments": {"a": 3, "b": 4}}\n</toolcall><|im_end|>',
        '<tool_call>\n{"arguments": {a: 3, b: 4}}\n</tool_call><|im_end|>',
    ]
    fake_generate, calls = scripted(trainer.processing_class, malformed, [])
    with patch.object(trainer.model, "generate", side_effect=fake_generate):
        trainer.train()
    assert set(calls) == {3}  # a second turn would mean a malformed call ran
    assert trainer.state.log_history[-1]["train_loss"] is not None
    every_parameter_changed(previous_trainable_params, trainer.model)


def test_train_with_unknown_environment_raises(hub, tmp_path):
    dataset = conversational_prompts(3).map(lambda example: {"environment": "unknown"})
    trainer = GRPOTrainer(
        model=hub["policy"], reward_funcs=hub["scorer"], args=swap_args(tmp_path, max_steps=1), train_dataset=dataset,
        environment_factory={"counter": IncrementEnvironment},
    )  # fmt: skip
    with pytest.raises(ValueError, match="not among the environments"):
        trainer.train()


class GuessEnvironment:
    def reset(self, **kwargs):
        self._solved = False

    def guess(self, word: str) -> str:
        """
        Submit a guess.

        Args:
            word: The guessed word.

        Returns:
            Feedback about the guess.
        """
        return "nope"

    def get_reward(self) -> float:
        return 1.0 if self._solved else 0.0


def format_reward(completions, **kwargs):
    return [0.0 for _ in completions]


def test_environment_owned_reward_coexists_with_reward_funcs(hub, tmp_path):
    trainer = GRPOTrainer(
        model=hub["policy"], reward_funcs=format_reward, args=swap_args(tmp_path, max_steps=5, reward_weights=[0.5]),
        environment_factory=GuessEnvironment,
    )  # fmt: skip
    assert trainer.reward_func_names == ["format_reward", "GuessEnvironment"]
    assert trainer.reward_weights.tolist() == [0.5, 1.0]
    assert len(trainer.reward_funcs) == 2
    tool_names = [tool.__name__ for tool in trainer.tools]
    assert "guess" in tool_names and "get_reward" not in tool_names


def test_environment_owned_reward_mixed_environments(hub, tmp_path):
    class ScoredEnvironment:  # owns its reward
        def reset(self, **kwargs): ...

        def act(self, x: int) -> int:
            """
            Act.

            Args:
                x: A value.

            Returns:
                The value.
            """
            return x

        def get_reward(self) -> float:
            return 1.0

    class PlainEnvironment:  # no get_reward: scored by reward_funcs
        def reset(self, **kwargs): ...

        def play(self, x: int) -> int:
            """
            Play.

            Args:
                x: A value.

            Returns:
                The value.
            """
            return x

    dataset = Dataset.from_dict({"environment": ["scored", "scored2", "plain"]})
    trainer = GRPOTrainer(
        model=hub["policy"], reward_funcs=format_reward, args=swap_args(tmp_path), train_dataset=dataset,
        environment_factory={"scored": ScoredEnvironment, "scored2": ScoredEnvironment, "plain": PlainEnvironment},
    )  # fmt: skip
    assert trainer.reward_func_names == ["format_reward", "ScoredEnvironment"]
    assert trainer.reward_weights.tolist() == [1.0, 1.0]
    env_reward_func = trainer.reward_funcs[-1]
    assert env_reward_func(environments=[ScoredEnvironment(), PlainEnvironment()]) == [1.0, None]
