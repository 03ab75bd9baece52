"""Multi-turn trajectories (issue 35): the environment's tokens (``env_mask`` 0) attended to but never trained on —
GAE over the policy's tokens only, the score on the last token the policy wrote, the losses and KL masked — and the
user's ``rollout_func`` (TRL GRPO's contract) generating the training rollouts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import make_trainer
from torch.testing import assert_close

from trl_ppomax.base import core
from trl_ppomax.base import metrics as M
from trl_ppomax.generation.rollout_func import call_rollout_func
from trl_ppomax.ppo import update
from trl_ppomax.toyworld.tiny import build_models


# -- The maths, by hand ------------------------------------------------------------------------------------------------
def test_gae_skips_the_environments_tokens_by_hand():
    """Policy tokens at 0 and 3, a tool result at 1-2: γ = 1, λ = 0.5, r = [0, ·, ·, 1], V = [0.5, ·, ·, 0.2].
    δ_3 = 1 − 0.2 = 0.8 = A_3; δ_0 = 0 + V_3 − V_0 = −0.3, A_0 = −0.3 + 0.5·0.8 = 0.1; R = A + V = [0.6, 0, 0, 1]."""
    rewards = torch.tensor([[0.0, 9.0, 9.0, 1.0]])
    values = torch.tensor([[0.5, 7.0, 7.0, 0.2]])  # the environment's values and rewards play no part
    mask = torch.tensor([[1, 0, 0, 1]])
    advantages, returns = core.compute_gae(rewards, values, mask, gamma=1.0, lam=0.5)
    assert_close(advantages, torch.tensor([[0.1, 0.0, 0.0, 0.8]]))
    assert_close(returns, torch.tensor([[0.6, 0.0, 0.0, 1.0]]))


def test_gae_with_holes_is_gae_over_the_policys_tokens_alone():
    """Random trajectories: GAE with the environment's tokens left in place equals GAE on the policy's tokens
    packed together (verl's multi-turn GAE), scattered back."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        mask = (torch.rand(3, 9, generator=g) < 0.6).long()
        rewards, values = torch.randn(3, 9, generator=g), torch.randn(3, 9, generator=g)
        advantages, returns = core.compute_gae(rewards, values, mask, 0.9, 0.8)
        for row in range(3):
            kept = mask[row].bool()
            if not kept.any():
                continue
            packed = core.compute_gae(
                rewards[row, kept][None], values[row, kept][None], mask[row, kept][None], 0.9, 0.8
            )
            assert_close(advantages[row, kept], packed[0][0])
            assert_close(returns[row, kept], packed[1][0])
            assert (advantages[row, ~kept] == 0).all()


def test_the_score_lands_on_the_last_token_the_policy_wrote():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    assert core.last_token_index(mask).tolist() == [4, 0, 0]
    rewards, _ = core.token_rewards(torch.tensor([2.0, 3.0, 5.0]), torch.zeros(3, 6), mask, kl_coef=0.1)
    assert rewards[0].tolist() == [0, 0, 0, 0, 2.0, 0] and rewards[1].tolist() == [3.0, 0, 0, 0, 0, 0]


# -- rollout_func: a two-turn "tool" trajectory ------------------------------------------------------------------------
TOOL_RESULT = [5, 6, 7]  # the environment's tokens inserted between the two turns


def two_turn_rollout(prompts, trainer):
    """Turn 1 (3 tokens) by the policy, a tool result (3 tokens, env_mask 0), turn 2 (2 tokens) by the policy: one
    completion per prompt given (TRL repeats each prompt num_generations times)."""
    tokenizer, policy = trainer.processing_class, trainer.accelerator.unwrap_model(trainer.model).policy
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        for _ in range(1):
            first = policy.generate(torch.tensor([ids]), do_sample=True, max_new_tokens=3, min_new_tokens=3)[
                0, len(ids) :
            ]
            context = torch.tensor([ids + first.tolist() + TOOL_RESULT])
            second = policy.generate(context, do_sample=True, max_new_tokens=2, min_new_tokens=2)[
                0, context.shape[1] :
            ]
            completion = first.tolist() + TOOL_RESULT + second.tolist()
            out["prompt_ids"].append(ids)
            out["completion_ids"].append(completion)
            out["logprobs"].append([0.0] * len(completion))
            out["env_mask"].append([1] * len(first) + [0] * len(TOOL_RESULT) + [1] * len(second))
    out["tool_calls"] = [1] * len(out["completion_ids"])  # an extra key: forwarded to the reward functions
    return out


def counted_reward(prompts, completions, tool_calls, **kwargs):
    assert len(tool_calls) == len(completions)
    return [float(len(c.split())) / 10 + calls for c, calls in zip(completions, tool_calls, strict=True)]


def test_a_rollout_func_run_trains_on_the_policys_tokens_only(tmp_path):
    seen = []
    critic = build_models(seed=1)[2]
    trainer = make_trainer(
        tmp_path, reward=counted_reward, value_model=critic, rollout_func=two_turn_rollout, total_episodes=16
    )
    make = trainer.experience_maker.make
    trainer.experience_maker.make = lambda rollout, step: seen.append(result := make(rollout, step)) or result
    before = {n: p.detach().clone() for n, p in trainer.model.policy.named_parameters()}
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.policy.named_parameters())
    experience = seen[0][0]
    rollout = experience.rollout
    tool = rollout.env_mask == 0
    assert tool.sum() == 3 * len(rollout.scores) and (rollout.response_mask[tool] == 1).all()  # attended to
    assert (experience.advantages[tool] == 0).all() and (experience.returns[tool] == 0).all()
    assert (experience.raw_advantages[~tool & rollout.response_mask.bool()] != 0).any()
    logged = [e for e in trainer.state.log_history if M.RESPONSE_LENGTH in e]
    assert logged and all(e[M.RESPONSE_LENGTH] == 5 for e in logged)  # the policy's tokens: 3 + 2
    assert all(e[M.SCORES] > 1 for e in logged)  # the extra key reached the reward function


def test_the_environments_tokens_add_nothing_to_the_loss(tmp_path):
    """Whatever the targets at the environment's positions (old log-probs, reference, values, returns, advantages),
    the micro-batch loss and every statistic are the same."""
    trainer = make_trainer(tmp_path, rollout_func=two_turn_rollout, total_episodes=16, kl_placement="loss")
    seen = []
    make = trainer.experience_maker.make
    trainer.experience_maker.make = lambda rollout, step: seen.append(result := make(rollout, step)) or result
    trainer.train()
    experience = seen[-1][0]
    tool = experience.rollout.env_mask == 0

    def noisy(tensor):
        return torch.where(tool, tensor + 100.0 * torch.randn_like(tensor.float()), tensor)

    rollout = dataclasses.replace(
        experience.rollout,
        ref_logprobs=noisy(experience.rollout.ref_logprobs),
        values=noisy(experience.rollout.values),
    )
    changed = dataclasses.replace(
        experience,
        rollout=rollout,
        old_logprobs=noisy(experience.old_logprobs),
        advantages=noisy(experience.advantages),
        returns=noisy(experience.returns),
    )
    rows = torch.arange(len(experience.rollout.scores))
    torch.manual_seed(0)
    loss, stats = update.micro_batch_loss(trainer.model, experience, rows, False, trainer.args)
    torch.manual_seed(0)
    loss_changed, stats_changed = update.micro_batch_loss(trainer.model, changed, rows, False, trainer.args)
    assert_close(loss, loss_changed)
    for name, value in stats.items():
        assert_close(value, stats_changed[name], msg=name)


# -- rollout_func's contract: clear errors, and the everyday setups ----------------------------------------------------
def test_rollout_func_output_is_checked_with_the_fix_named():
    prompts = ["a b", "c d"]
    good = {"prompt_ids": [[1, 2]] * 2, "completion_ids": [[3, 4], [5]], "logprobs": [[0.0, 0.0], [0.0]]}
    batch = call_rollout_func(lambda p, t: good, prompts, None, 1, 0, "cpu")
    assert batch.env_mask is None and batch.response_mask.tolist() == [[1, 1], [1, 0]]
    with pytest.raises(ValueError, match=r"\['logprobs'\] missing"):
        call_rollout_func(lambda p, t: {"prompt_ids": [], "completion_ids": []}, prompts, None, 1, 0, "cpu")
    with pytest.raises(ValueError, match=r"for the 4 prompts it was given .*one completion per prompt given"):
        call_rollout_func(lambda p, t: good, prompts, None, 2, 0, "cpu")
    seen = []  # TRL's contract: each prompt repeated num_generations times, in a row
    call_rollout_func(lambda p, t: seen.extend(p) or {k: v * 2 for k, v in good.items()}, prompts, None, 2, 0, "cpu")
    assert seen == ["a b", "a b", "c d", "c d"]
    with pytest.raises(ValueError, match="'env_mask' row 1 has 2 entries for 1"):
        call_rollout_func(lambda p, t: {**good, "env_mask": [[1, 0], [1, 1]]}, prompts, None, 1, 0, "cpu")
    with pytest.raises(ValueError, match="0 \\(environment\\) or 1"):
        call_rollout_func(lambda p, t: {**good, "env_mask": [[1, 2], [1]]}, prompts, None, 1, 0, "cpu")
    with pytest.raises(TypeError, match="must return a dict"):
        call_rollout_func(lambda p, t: [], prompts, None, 1, 0, "cpu")


def test_rollout_func_with_max_staleness_is_refused(tmp_path):
    with pytest.raises(ValueError, match="max_staleness=0 with a rollout_func"):
        make_trainer(tmp_path, rollout_func=two_turn_rollout, max_staleness=1)


def fixed_rollout(offset: float):
    """A rollout_func writing the same two-turn completions each call, with log-probs ``offset`` (another sampler's)."""

    def rollout_func(prompts, trainer):
        completion, env_mask = [4, 5, 6, 7, 8, 3], [1, 1, 0, 0, 1, 1]
        rows = len(prompts)  # each prompt repeated num_samples_per_prompt times, as TRL passes them
        ids = trainer.processing_class(prompts[0])["input_ids"]
        return {"prompt_ids": [ids] * rows, "completion_ids": [completion] * rows, "env_mask": [env_mask] * rows,
                "logprobs": [[offset] * len(completion)] * rows}  # fmt: skip

    return rollout_func


def test_rollout_func_logprobs_correct_for_another_sampler_on_the_policys_tokens_only(tmp_path):
    """w = π/μ: halving log μ by one nat multiplies every policy token's weight by e; environment tokens get none."""
    weights = {}
    for offset in (-3.0, -4.0):
        trainer = make_trainer(
            tmp_path, rollout_func=fixed_rollout(offset), rollout_func_importance_sampling=True,
            vllm_importance_sampling_clip_max=1e9, output_dir=tmp_path / str(offset),
        )  # fmt: skip
        rollout = trainer.rollouts.training(1)  # the user's rollout_func on the first batch, scored
        weights[offset] = rollout.sampling_weights
        policy = rollout.policy_mask.bool()
        assert (rollout.sampling_weights[~policy] <= 1).all()
        assert M.SAMPLING_LOGP_DIFF_MEAN in trainer.generation.pop_metrics()  # the gap is logged
    policy = rollout.policy_mask.bool()
    assert_close(weights[-4.0][policy] / weights[-3.0][policy], torch.full((int(policy.sum()),), 2.718281828))
    off = make_trainer(tmp_path, rollout_func=fixed_rollout(-3.0), output_dir=tmp_path / "off")
    assert off.rollouts.training(1).sampling_weights is None


# -- rollout_func's faults found in round four: refused naming the key, row and fix; the everyday output passes --------
GOOD = {"prompt_ids": [[1, 2]] * 2, "completion_ids": [[3, 4], [5]], "logprobs": [[-0.5, -1.0], [-2.0]]}


def checked(output, **checks):
    return call_rollout_func(lambda p, t: output, ["a b", "c d"], None, 1, 0, "cpu", **checks)


@pytest.mark.parametrize("key", ["completions", "prompts", "prompt", "sequence_texts", "environments"])
def test_an_extra_key_that_reward_functions_already_receive_is_refused(key):
    with pytest.raises(ValueError, match=rf"extra key '{key}', which is what reward functions receive.*Rename"):
        checked({**GOOD, key: ["x", "y"]})


def test_an_extra_key_named_as_a_dataset_column_is_refused_and_others_pass():
    with pytest.raises(ValueError, match="extra key 'answer', which is a dataset column"):
        checked({**GOOD, "answer": ["1", "2"]}, columns={"answer", "prompt"})
    batch = checked({**GOOD, "tool_calls": [1, 0]}, columns={"answer", "prompt"})
    assert batch.columns == {"tool_calls": [1, 0]}


def test_ids_outside_the_vocabulary_are_refused_before_the_embedding():
    with pytest.raises(ValueError, match=r"'completion_ids' row 1 holds ids outside the policy's vocabulary \[0, 5\)"):
        checked(GOOD, vocab_size=5)
    with pytest.raises(ValueError, match=r"'prompt_ids' row 0 .*\[-100\]"):
        checked({**GOOD, "prompt_ids": [[-100, 2], [1, 2]]}, vocab_size=50)
    assert checked(GOOD, vocab_size=6).response_ids.max() == 5


def test_a_trajectory_longer_than_the_context_is_refused():
    with pytest.raises(ValueError, match="row 0 has 2 prompt and 2 completion tokens, more than the policy's context"):
        checked(GOOD, context_length=3)
    assert checked(GOOD, context_length=4).response_ids.shape == (2, 2)


def test_tensors_and_arrays_are_taken_as_lists():
    import numpy as np

    as_tensors = {
        "prompt_ids": torch.tensor([[1, 2], [1, 2]]),
        "completion_ids": [torch.tensor([3, 4]), np.array([5])],
        "logprobs": [torch.tensor([-0.5, -1.0]), torch.tensor([-2.0])],
        "env_mask": [torch.tensor([1, 0]), torch.tensor([1])],
    }
    batch, lists = checked(as_tensors), checked({**GOOD, "env_mask": [[1, 0], [1]]})
    for field in ("query_ids", "response_ids", "response_mask", "sampler_logprobs", "env_mask"):
        assert torch.equal(getattr(batch, field), getattr(lists, field)), field


@pytest.mark.parametrize("bad", [0.5, float("nan"), float("-inf")])
def test_importance_sampling_refuses_impossible_logprobs(bad):
    output = {**GOOD, "logprobs": [[-0.5, bad], [-2.0]]}
    with pytest.raises(ValueError, match=r"'logprobs' row 0 token 1 .*finite and ≤ 0"):
        checked(output, importance_sampling=True)
    checked(output)  # without importance sampling they are not used
    checked({**GOOD, "logprobs": [[0.0, -1e-9], [1e-4]]}, importance_sampling=True)  # 0 and a sampler's rounding pass


def test_an_env_mask_of_zeros_only_is_warned_about(caplog):
    with caplog.at_level("WARNING", logger="trl_ppomax.generation.rollout_func"):
        checked({**GOOD, "env_mask": [[0, 0], [0]]})
    assert "env_mask is 0 on every completion token" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="trl_ppomax.generation.rollout_func"):
        checked({**GOOD, "env_mask": [[1, 0], [1]]})
    assert caplog.text == ""


def test_a_training_run_refuses_a_clashing_key_and_an_id_beyond_the_vocabulary(tmp_path):
    def clashing(prompts, trainer):
        out = two_turn_rollout(prompts, trainer)
        return {**out, "completions": ["x"] * len(out["completion_ids"])}

    with pytest.raises(ValueError, match="extra key 'completions'"):
        make_trainer(tmp_path / "a", rollout_func=clashing, total_episodes=16).train()

    def beyond(prompts, trainer):
        out = two_turn_rollout(prompts, trainer)
        out["completion_ids"][0][-1] = 10**6
        return out

    with pytest.raises(ValueError, match="'completion_ids' row 0 holds ids outside the policy's vocabulary"):
        make_trainer(tmp_path / "b", rollout_func=beyond, total_episodes=16).train()
