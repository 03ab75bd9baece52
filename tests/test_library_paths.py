"""The trainer runs library fast paths (trl, accelerate, transformers, peft) where they do the job; each must equal
the readable reference it replaced: the definitions in ``core`` or the behaviour of the hand-written code."""

from __future__ import annotations

import pytest
import torch
from accelerate.state import PartialState
from helpers import make_trainer
from trl.trainer.utils import selective_log_softmax, selective_log_softmax_and_entropy

from trl_ppomax.base import core
from trl_ppomax.data import rows_of_this_process
from trl_ppomax.models import load_weights, reference_policy
from trl_ppomax.toyworld.tiny import build_models


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_selective_log_softmax_equals_core_logprobs(temperature):
    generator = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(3, 5, 50, generator=generator)
    tokens = torch.randint(0, 50, (3, 5), generator=generator)
    expected = core.logprobs_from_logits(logits, tokens, temperature)
    torch.testing.assert_close(selective_log_softmax(logits, tokens, temperature=temperature), expected)


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_one_pass_logprobs_and_entropy_equal_core_with_gradients(temperature):
    generator = torch.Generator().manual_seed(1)
    base = 3 * torch.randn(2, 4, 40, generator=generator)
    tokens = torch.randint(0, 40, (2, 4), generator=generator)
    weights = torch.randn(2, 4, generator=generator)

    fast_logits = base.clone().requires_grad_(True)
    logprobs, entropy = selective_log_softmax_and_entropy(fast_logits, tokens, temperature=temperature)
    ((logprobs + entropy) * weights).sum().backward()

    reference_logits = base.clone().requires_grad_(True)
    ref_logprobs = core.logprobs_from_logits(reference_logits, tokens, temperature)
    ref_entropy = core.entropy_from_logits(reference_logits, temperature)
    ((ref_logprobs + ref_entropy) * weights).sum().backward()

    torch.testing.assert_close(logprobs, ref_logprobs)
    torch.testing.assert_close(entropy, ref_entropy)
    torch.testing.assert_close(fast_logits.grad, reference_logits.grad)


def test_entropy_without_gradient_when_the_bonus_is_off():
    logits = torch.randn(2, 3, 10, requires_grad=True)
    _, entropy = selective_log_softmax_and_entropy(logits, torch.zeros(2, 3, dtype=torch.long), False)
    assert not entropy.requires_grad
    torch.testing.assert_close(entropy, core.entropy_from_logits(logits.detach()))


class _Processes:
    """Just enough of accelerate's state to split rows as process ``index`` of ``count`` would."""

    def __init__(self, count: int, index: int) -> None:
        self.num_processes, self.process_index, self.device = count, index, torch.device("cpu")

    def split_between_processes(self, inputs, apply_padding=False):
        return PartialState.split_between_processes(self, inputs, apply_padding=apply_padding)


@pytest.mark.parametrize(("num_rows", "processes"), [(10, 1), (10, 3), (2, 4), (8, 2)])
def test_evaluation_rows_cover_each_prompt_once_with_equal_counts(num_rows, processes):
    shares = [rows_of_this_process(num_rows, _Processes(processes, i)) for i in range(processes)]
    assert len({len(rows) for rows, _ in shares}) == 1  # every process runs the same number of chunks
    real = sorted(row for rows, weights in shares for row, w in zip(rows, weights, strict=True) if w == 1.0)
    assert real == list(range(num_rows))
    assert all(w in (0.0, 1.0) for _, weights in shares for w in weights)


def test_reference_adapter_switch_restores_the_active_adapter(tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = make_trainer(tmp_path, peft_config=lora, ref_adapter_name="reference")
    policy = trainer.model.policy
    policy.add_adapter("reference", lora)
    policy.add_adapter("other", lora)
    policy.set_adapter("other")
    with reference_policy(trainer.ref_model, policy, trainer.args.ref_adapter_name) as reference:
        assert reference.active_adapter == "reference"
    assert policy.active_adapter == "other"  # the hand-written switch reset to "default"


@pytest.mark.parametrize("shard_size", [None, "20KB"])
def test_load_weights_single_file_and_sharded(tmp_path, shard_size):
    _, source, _ = build_models()
    _, target, _ = build_models()
    with torch.no_grad():
        for parameter in source.parameters():
            parameter.add_(1.0)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    source.save_pretrained(tmp_path, **kwargs)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard_size is not None)
    load_weights(target, tmp_path)
    for (name, expected), actual in zip(source.state_dict().items(), target.state_dict().values(), strict=True):
        torch.testing.assert_close(actual, expected, msg=name)


def test_accumulated_step_uses_the_mean_of_micro_batch_gradients(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, gradient_accumulation_steps=2, num_mini_batches=1, per_device_train_batch_size=4)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(trainer.args.local_batch_size)])
    experience, _, _ = trainer.make_experience(trainer.rollout(batch["input_ids"], batch["attention_mask"]))
    captured = []

    def capture_instead_of_stepping(*_args):
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        captured.append((trainer.accelerator.sync_gradients, grads))
        trainer.optimizer.zero_grad()
        return {}

    monkeypatch.setattr("trl_ppomax.ppo.optim.optimizer_step", capture_instead_of_stepping)
    torch.manual_seed(3)
    trainer.ppo_update(experience)
    ((synced, accumulated),) = captured

    torch.manual_seed(3)
    order = torch.randperm(trainer.args.local_batch_size)
    micro_batches = order.split(trainer.args.per_device_train_batch_size)
    for micro in micro_batches:
        loss, _ = trainer.micro_batch_loss(experience, micro, critic_only=False)
        (loss / len(micro_batches)).backward()
    expected = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}

    assert synced and len(micro_batches) == 2
    assert accumulated.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(accumulated[name], grad, msg=name)
