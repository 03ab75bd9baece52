"""TRL-compatible reward sources: GRPO-style keyword reward functions (``trl.rewards``), extra dataset columns,
mixed weighted lists with ``rewards/<name>/mean`` logs, reward models with their own tokenizer, the old positional
form."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from datasets import Dataset
from helpers import TINY, changed, make_trainer, snapshot
from transformers import AutoModelForSequenceClassification
from user_setups import build_llama_style_tokenizer

from trl_ppomax import PPOMaxConfig, PPOMaxTrainer, rewards
from trl_ppomax.rewards import call_reward_function, functions
from trl_ppomax.toyworld.tiny import build_models, llama_config, prompt_texts

SMALL = {**TINY, "gradient_accumulation_steps": 1, "num_mini_batches": 1, "total_episodes": 8}


def train(tmp_path, dataset=None, value_model=None, **kwargs):
    """Train two tiny iterations; returns ``(trainer, logged keys)`` after checking the policy changed."""
    tokenizer, policy, reward_model = build_models("llama")
    weights = kwargs.pop("reward_weights", None)
    args = PPOMaxConfig(output_dir=str(tmp_path / "out"), reward_weights=weights, **SMALL)
    kwargs.setdefault("reward_model", reward_model)
    if value_model is None and not isinstance(kwargs.get("reward_funcs", kwargs["reward_model"]), torch.nn.Module):
        value_model = build_models("llama")[2]
    trainer = PPOMaxTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        train_dataset=dataset if dataset is not None else Dataset.from_dict({"prompt": prompt_texts(8)}),
        value_model=value_model,
        **kwargs,
    )
    before = snapshot(trainer.model.policy)
    trainer.train()
    assert changed(before, trainer.model.policy) > 0
    return trainer, {k for entry in trainer.state.log_history for k in entry}


def conversations(n: int = 8) -> list[list[dict]]:
    return [[{"role": "user", "content": text}] for text in prompt_texts(n)]


def test_trl_reward_functions_run_unchanged(tmp_path):
    from trl.rewards import get_soft_overlong_punishment, think_format_reward

    seen = {}

    def spy(completions, completion_ids, **kwargs):
        seen.update(completions=completions, completion_ids=completion_ids, kwargs=kwargs)
        return [float(len(ids)) for ids in completion_ids]

    overlong = get_soft_overlong_punishment(max_completion_len=6, soft_punish_cache=3)
    dataset = Dataset.from_dict({"prompt": conversations()})
    _, logged = train(tmp_path, dataset=dataset, reward_funcs=[think_format_reward, overlong, spy])
    assert {"rewards/think_format_reward/mean", "rewards/spy/mean", "objective/scores"} <= logged
    assert any(key.startswith("rewards/") and "soft_overlong" in key for key in logged), logged
    assert seen["completions"][0][0]["role"] == "assistant"  # conversational completions as message lists
    assert seen["kwargs"]["prompts"][0] == dataset["prompt"][0] or seen["kwargs"]["prompts"][0][0]["role"] == "user"


def test_extra_dataset_column_reaches_the_reward_function(tmp_path):
    texts = prompt_texts(8)
    calls = []

    def accuracy(prompts, completions, solution, **kwargs):
        calls.append((list(prompts), list(solution)))
        return [float(s in c) for c, s in zip(completions, solution, strict=True)]

    dataset = Dataset.from_dict({"prompt": texts, "solution": [t.split()[0] for t in texts]})
    _, logged = train(tmp_path, dataset=dataset, reward_funcs=accuracy)
    assert "rewards/accuracy/mean" in logged and "objective/scores" in logged
    by_prompt = dict(zip(texts, dataset["solution"], strict=True))
    for prompts, solutions in calls:
        assert [by_prompt[p] for p in prompts] == solutions  # each row's own solution, in the batch's order


def test_mixed_list_with_weights_logs_each_source(tmp_path):
    def length_bonus(completions, **kwargs):
        return [0.1 * len(c) for c in completions]

    reward_model = build_models("llama")[2]
    reward_model.config._name_or_path = "some/dir/tiny-rm"
    trainer, logged = train(tmp_path, reward_model=[reward_model, length_bonus], reward_weights=[1.0, 0.5])
    assert {"rewards/tiny-rm/mean", "rewards/length_bonus/mean"} <= logged
    history = [entry for entry in trainer.state.log_history if "rewards/tiny-rm/mean" in entry]
    for entry in history:  # no missing-eos penalty here: the score is the weighted sum of the sources
        combined = entry["rewards/tiny-rm/mean"] + 0.5 * entry["rewards/length_bonus/mean"]
        assert entry["objective/scores"] == pytest.approx(combined, rel=1e-4, abs=1e-5)
    assert trainer.reward_model is trainer.reward_sources.sources[0]  # the critic came from the reward model


def test_reward_weights_length_is_checked(tmp_path):
    with pytest.raises(ValueError, match="reward_weights has 1 entries for 2 reward sources"):
        rewards.RewardSources([len, len], weights=[1.0])


def test_reward_model_with_its_own_tokenizer(tmp_path):
    other = build_llama_style_tokenizer()
    other.pad_token = other.unk_token
    other.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    config = llama_config(other, num_labels=1)
    torch.manual_seed(3)
    foreign = AutoModelForSequenceClassification.from_config(config)
    assert foreign.get_input_embeddings().num_embeddings != len(build_models("llama")[0])
    for dataset in (None, Dataset.from_dict({"prompt": conversations()})):
        _, logged = train(tmp_path, dataset=dataset, reward_funcs=[foreign], reward_processing_classes=[other])
        assert "rewards/LlamaForSequenceClassification/mean" in logged

    # scored as the model itself scores the re-encoded text, right-padded
    prompts, completions = ["hello there", "a"], [" how are you", " b c"]
    texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    scores = rewards.score_with_own_tokenizer(foreign, other, texts, torch.device("cpu"))
    for prompt, completion, score in zip(prompts, completions, scores, strict=True):
        alone = foreign(**other(prompt + completion, return_tensors="pt")).logits[0, 0]
        assert score.item() == pytest.approx(alone.item(), abs=1e-5)


def test_the_critic_comes_from_the_policy_without_a_reward_model_on_its_tokens():
    other = build_llama_style_tokenizer()
    foreign = AutoModelForSequenceClassification.from_config(llama_config(other, num_labels=1, pad_token_id=0))
    assert rewards.RewardSources([foreign], processing_classes=[other]).critic_source() is None
    assert rewards.RewardSources([len]).critic_source() is None
    assert rewards.RewardSources([len, foreign], [None, other]).critic_source(value_model=foreign) is foreign


def test_old_positional_form_still_works(tmp_path):
    seen = []

    def gold(p, c):
        seen.append((p, c))
        return [float(len(x)) for x in c]

    _, logged = train(tmp_path, reward_model=gold)
    assert "rewards/gold/mean" in logged
    assert all(isinstance(p[0], str) and isinstance(c[0], str) for p, c in seen)
    # a (prompts, completions) function is called by keyword, which is the same
    scores = rewards.call_reward_function(lambda prompts, completions: [1.0] * 2, ["a", "b"], ["c", "d"], "cpu")
    assert scores.tolist() == [1.0, 1.0]
    assert functions.is_positional_pair(gold) and not functions.is_positional_pair(lambda completions, **kw: [])


def test_recipe_reward_funcs_dotted_paths():
    from trl import TrlParser

    from trl_ppomax.cli.ppo import PPOMaxScriptArguments

    (script_args,) = TrlParser((PPOMaxScriptArguments,)).parse_args_into_dataclasses(
        ["--dataset_name", "x", "--reward_funcs", "trl.rewards.think_format_reward", "os.path.join"]
    )
    functions = [rewards.load_reward_function(path) for path in script_args.reward_funcs]
    assert functions[0].__name__ == "think_format_reward"
    with pytest.raises(ValueError, match="could not be imported"):
        rewards.load_reward_function("trl.rewards.no_such_reward")


def test_stored_reward_statistics_follow_the_weight_and_not_a_sum():
    reward_model = build_models("llama")[2]
    for key, value in {"reward_mean": 0.5, "reward_std": 2.0, "reward_stats_count": 100.0}.items():
        setattr(reward_model.config, key, value)
    alone = rewards.initial_reward_moments(rewards.RewardSources(reward_model), "running")
    assert (alone.count, alone.mean, alone.std) == pytest.approx((100, 0.5, 2.0))
    scaled = rewards.initial_reward_moments(rewards.RewardSources(reward_model, weights=[10.0]), "running")
    assert (scaled.count, scaled.mean, scaled.std) == pytest.approx((100, 5.0, 20.0))  # 10·r: mean 10μ, std 10σ
    summed = rewards.initial_reward_moments(rewards.RewardSources([reward_model, len], weights=[1.0, 1.0]), "running")
    assert summed.count == 0  # the sum of two sources has no stored statistics
    assert rewards.initial_reward_moments(rewards.RewardSources(reward_model), "none").count == 0


def test_async_reward_functions_are_awaited_concurrently(tmp_path):
    """``async def`` reward functions, as GRPOTrainer awaits them: the two of a batch run at once (each waits until
    the other has started, which would time out if they were awaited one after the other), and their scores are
    combined like any function's."""
    import asyncio

    started: dict = {}  # per event loop (one per batch): the functions that have started

    async def meet(name):
        here = started.setdefault(id(asyncio.get_running_loop()), {"short": asyncio.Event(), "long": asyncio.Event()})
        here[name].set()
        await asyncio.wait_for(here["long" if name == "short" else "short"].wait(), timeout=5)

    async def short(completions, **kwargs):
        await meet("short")
        return [-float(len(c)) for c in completions]

    async def long(completions, completion_ids, **kwargs):
        await meet("long")
        return [float(len(ids)) for ids in completion_ids]

    _, logged = train(tmp_path, reward_funcs=[short, long])
    assert {"rewards/short/mean", "rewards/long/mean", "objective/scores"} <= logged


def test_async_rollout_metrics_and_a_running_event_loop():
    """``rewards.awaited`` also works where an event loop already runs (a notebook)."""
    import asyncio

    async def score(x):
        await asyncio.sleep(0)
        return x + 1

    async def inside_a_loop():
        return rewards.awaited([score(1), 5, score(2)])

    assert rewards.awaited([score(1), 5]) == [2, 5]
    assert asyncio.run(inside_a_loop()) == [2, 5, 3]


def test_a_function_returning_none_for_every_sample_is_said_as_none(tmp_path, caplog):
    def abstains(completions, **kwargs):
        return [None] * len(completions)

    trainer = make_trainer(tmp_path, reward=abstains, value_model=build_models("llama")[2], max_skipped_iterations=1)
    with caplog.at_level("WARNING"), pytest.raises(RuntimeError, match=r"no finite reward \(None, NaN or inf\)"):
        trainer.train()
    assert "The reward function 'abstains' returned None for all 16 completions" in caplog.text


REWARD_OUTPUTS = [
    ("dict", lambda n: {"a": 1.0, "b": 2.0}, r"did not return a sequence of scores\. It returned dict \{'a': 1.0"),
    ("None", lambda n: None, r"did not return a sequence of scores\. It returned NoneType None"),
    ("scalar", lambda n: 1.5, r"did not return a sequence of scores\. It returned float 1.5"),
    ("string", lambda n: "1.0", r"did not return a sequence of scores\. It returned str '1.0'"),
    ("too-few", lambda n: [0.0] * (n - 1), r"it returned 3 scores for 4 completions.*one number per completion"),
    ("too-many", lambda n: np.zeros(n + 1), r"it returned 5 scores for 4 completions"),
    ("texts", lambda n: ["good"] * n, r"must return numbers, but 4 of its 4 scores are not \(e.g. str 'good'\)"),
    ("2-D", lambda n: torch.zeros(n, 1), r"did not return a sequence of scores\. It returned Tensor"),
]


@pytest.mark.parametrize(("make", "pattern"), [r[1:] for r in REWARD_OUTPUTS], ids=[r[0] for r in REWARD_OUTPUTS])
def test_reward_function_output_is_checked(make, pattern):
    def judge(prompts, completions):
        return make(len(prompts))

    with pytest.raises(ValueError, match=r"The reward function 'judge' is at fault: .*" + pattern):
        call_reward_function(judge, ["p"] * 4, ["c"] * 4, torch.device("cpu"))


@pytest.mark.parametrize(
    "returned",
    [[1, 2.5], (True, 0.5), np.array([1.0, 2.5]), torch.tensor([1.0, 2.5]), [torch.tensor(1.0), np.float32(2.5)]],
    ids=["list", "tuple", "numpy", "tensor", "scalars"],
)
def test_reward_function_accepts_sequences_of_numbers(returned):
    scores = call_reward_function(lambda p, c: returned, ["p"] * 2, ["c"] * 2, torch.device("cpu"))
    assert scores.shape == (2,) and scores.dtype == torch.float32


def test_reward_function_fault_stops_the_first_rollout_before_any_update(tmp_path):
    """A reward function can only be judged by calling it: the first rollout calls it, and fails before any update."""
    trainer = make_trainer(tmp_path, reward=lambda p, c: {"score": 1.0}, value_model=build_models()[2])
    before = snapshot(trainer.model.policy)
    with pytest.raises(ValueError, match=r"reward function '<lambda>' is at fault.*returned dict"):
        trainer.train()
    assert all(torch.equal(before[name], p) for name, p in trainer.model.policy.named_parameters())


@pytest.mark.parametrize(
    "function", [lambda p, c, **k: [0.0] * len(p), lambda a: [0.0] * len(a)], ids=["p-c-kwargs", "one-argument"]
)
def test_a_reward_function_that_cannot_be_called_is_told_how_reward_functions_are_called(function):
    """Old-style fn(p, c, **k) and fn(a) gave a raw TypeError naming a lambda (from inside the call)."""
    with pytest.raises(TypeError) as caught:
        call_reward_function(function, ["p"] * 2, ["c"] * 2, torch.device("cpu"), completion_ids=[[1], [2]])
    message = str(caught.value)
    assert re.match(r"The reward function '<lambda>'\(.+\) cannot be called: its parameters? .+ would get no", message)
    assert "f(prompts=..., completions=..., completion_ids=..., **dataset columns" in message
    assert "f(prompts, completions), and no **kwargs" in message


def test_reward_functions_callable_either_way_are_accepted_and_their_own_type_errors_kept():
    def solution_reward(prompts, completions, solution, **kwargs):
        return [0.0] * len(prompts)

    accepted = [solution_reward, lambda p, c: [0.0], lambda completions, **kw: [0.0], lambda prompts, x=1: [0.0]]
    rewards.check_reward_functions(accepted, ["prompt", "input_ids", "solution"])

    def buggy(prompts, completions):
        raise TypeError("unsupported operand type(s) inside the function")

    with pytest.raises(TypeError, match=r"^unsupported operand type"):  # its own error, not ours
        call_reward_function(buggy, ["p"], ["c"], torch.device("cpu"))
