"""``advantage_estimator="grpo"`` is TRL's GRPO objective: on the same completions (scripted through each trainer's
``model.generate``), the same rewards and the same tiny Qwen policy, ``PPOMaxTrainer``'s loss and every gradient equal
``trl.GRPOTrainer``'s (float32, to 1e-6) for each ``loss_type`` and ``scale_rewards``, with and without TRL's KL loss.
TRL is run here, in process, as the oracle, in float32 (``bf16=False``: GRPOConfig's default autocasts to bfloat16
even on CPU, 1e-3 off in the log-probs)."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from datasets import Dataset
from user_setups import write_qwen_instruct_folder

from trl_ppomax import PPOMaxConfig, PPOMaxTrainer, data
from trl_ppomax.ppo import batching

trl = pytest.importorskip("trl")

N, LENGTH = 4, 12  # completions per prompt, max_completion_length
#: Two prompts of one token length (no left padding: TRL's forward takes no position ids), four completions each.
PROMPTS = ["Beautiful is better than", "Explicit is better than."]
COMPLETIONS = ["ugly.<|im_end|>", "a<|im_end|>", "nice and good<|im_end|>", "never stops here at all",
               "implicit.<|im_end|>", "so<|im_end|>", "ok ok<|im_end|>", "bb<|im_end|>"]  # fmt: skip


def length_reward(completion_ids, **kwargs):
    return [float(len(ids) % 5) - 2.0 for ids in completion_ids]


@pytest.fixture(scope="module")
def policy_folder(tmp_path_factory):
    return write_qwen_instruct_folder(tmp_path_factory.mktemp("grpo-oracle") / "tiny-Qwen2.5")


def scripted_generate(tokenizer):
    """Each call appends row ``i``'s completion of :data:`COMPLETIONS` (right-padded) to the prompts."""

    def fake_generate(input_ids, **kwargs):
        rows = [
            tokenizer(COMPLETIONS[i], add_special_tokens=False)["input_ids"][:LENGTH] for i in range(len(input_ids))
        ]
        padded = [row + [tokenizer.pad_token_id] * (LENGTH - len(row)) for row in rows]
        return torch.cat([input_ids, torch.tensor(padded)], dim=-1)

    return fake_generate


SETTINGS = dict(
    per_device_train_batch_size=len(COMPLETIONS), num_generations=N, max_completion_length=LENGTH, temperature=1.0,
    report_to="none", use_cpu=True, gradient_checkpointing=False, learning_rate=1e-6, shuffle_dataset=False, bf16=False,
)  # fmt: skip


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def trl_loss_and_grads(folder, tmp_path, **objective):
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), **SETTINGS, **objective)
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    trainer = trl.GRPOTrainer(model=str(folder), reward_funcs=length_reward, args=args, train_dataset=dataset)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; one step here
    rows = [{"prompt": prompt} for prompt in PROMPTS for _ in range(N)]  # TRL's RepeatSampler order
    with patch.object(trainer.model, "generate", side_effect=scripted_generate(trainer.processing_class)):
        inputs = trainer._prepare_inputs(rows)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), grads(trainer.model)


def our_loss_and_grads(folder, tmp_path, **objective):
    args = PPOMaxConfig(
        output_dir=str(tmp_path / "ours"), advantage_estimator="grpo", reward_norm="none", reward_clip=None,
        **SETTINGS, **objective,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    trainer = PPOMaxTrainer(model=str(folder), reward_funcs=length_reward, args=args, train_dataset=dataset)
    batch, columns = data.split_batch(data.PromptCollator(0)([trainer.train_dataset[i] for i in (0, 1)]), "cpu")
    with patch.object(trainer.model, "generate", side_effect=scripted_generate(trainer.processing_class)):
        rollout = trainer.rollout(batch["input_ids"], batch["attention_mask"], True, columns, N)
    experience, _, problem = trainer.make_experience(rollout)
    assert problem is None
    ((rows, weights),) = batching.update_micro_batches(
        experience.rollout, torch.arange(len(COMPLETIONS)), args, trainer.accelerator, None
    )
    trainer.model.train()
    loss, _ = trainer.micro_batch_loss(experience, rows, critic_only=False, loss_weights=weights)
    loss.backward()
    return loss.detach(), {name.removeprefix("policy."): g for name, g in grads(trainer.model).items()}


def grid() -> list:
    """Every loss_type × scale_rewards × beta; the default suite runs each loss_type and each scale_rewards once (with
    TRL's KL), the slow one all."""
    cases = []
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        for scale_rewards in ("group", "batch", "none"):
            for beta in (0.0, 0.04):
                quick = beta and (scale_rewards == "group" or loss_type == "grpo")
                marks = () if quick else (pytest.mark.slow,)
                cases.append(pytest.param(loss_type, scale_rewards, beta, marks=marks))
    return cases


@pytest.mark.parametrize(("loss_type", "scale_rewards", "beta"), grid())
def test_the_grpo_objective_equals_trls(policy_folder, tmp_path, loss_type, scale_rewards, beta):
    objective = dict(loss_type=loss_type, scale_rewards=scale_rewards, beta=beta)
    theirs, their_grads = trl_loss_and_grads(policy_folder, tmp_path, **objective)
    ours, our_grads = our_loss_and_grads(policy_folder, tmp_path, **objective)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    assert set(our_grads) == set(their_grads)
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, atol=1e-6, rtol=1e-6, msg=name)
