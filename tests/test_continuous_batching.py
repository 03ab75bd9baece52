"""transformers' continuous batching as the generation engine (``use_transformers_continuous_batching``,
``trl_ppomax.generation.continuous_batching``): the registry picks it from the config, it keeps the engine contract
(``n`` rows per prompt in a row, right-padded, the mask on the generated tokens), and a run trains on it."""

from __future__ import annotations

import pytest
import torch
from helpers import changed, make_trainer, snapshot

from trl_ppomax import PPOMaxConfig
from trl_ppomax.base import metrics as M
from trl_ppomax.generation import ENGINES, HFGeneration, generate_responses
from trl_ppomax.generation.continuous_batching import ContinuousBatchingEngine

#: A small paged cache: transformers sizes it from free memory otherwise (seconds on a CPU).
SMALL_CACHE = {"num_blocks": 64, "max_batch_tokens": 256}


def batching_trainer(tmp_path, **overrides):
    return make_trainer(
        tmp_path,
        use_transformers_continuous_batching=True,
        transformers_continuous_batching_config=SMALL_CACHE,
        **overrides,
    )


def prompts(trainer, texts=("hello how are you", "tell me a story", "hi")):
    batch = trainer.processing_class(list(texts), return_tensors="pt", padding=True)
    return batch["input_ids"], batch["attention_mask"]


def test_the_registry_picks_continuous_batching_from_the_config(tmp_path):
    trainer = batching_trainer(tmp_path)
    assert isinstance(trainer.generation, ContinuousBatchingEngine) and trainer.vllm is None
    assert list(ENGINES) == ["vllm", "continuous_batching", "generate"]
    assert type(make_trainer(tmp_path / "plain").generation) is HFGeneration  # the everyday default is unchanged


def test_rows_come_n_in_a_row_per_prompt_with_the_mask_on_the_generated_tokens(tmp_path):
    trainer = batching_trainer(tmp_path, response_length=6)
    engine, stop = trainer.generation, trainer.stop_token_id
    ids, mask = prompts(trainer)
    responses, response_mask, sampler = engine.generate(ids, mask, sampling=False, n=2)
    assert sampler is None and responses.shape[0] == 6 and responses.shape[1] <= 6
    assert torch.equal(responses[0::2], responses[1::2])  # greedy: a prompt's two rows are the same
    lengths = response_mask.sum(1)
    for row, length in zip(responses, lengths.tolist(), strict=True):
        assert (row[length:] == trainer.processing_class.pad_token_id).all()
        assert length == 6 or row[length - 1] == stop  # ends at the stop token (kept) or at response_length
    # prompt i's rows are prompt i's: the first greedy token is what the policy's own generate picks
    kwargs = HFGeneration(engine.policy, trainer.args, stop, trainer.processing_class.pad_token_id).generation_kwargs(
        False, ids.shape[1]
    )
    expected, _ = generate_responses(engine.policy, ids, mask, {**kwargs, "max_new_tokens": 1})
    assert torch.equal(responses[0::2, 0], expected[:, 0])


def test_a_run_trains_on_continuous_batching(tmp_path):
    trainer = batching_trainer(tmp_path)
    before = snapshot(trainer.model.policy)
    trainer.train()
    assert changed(before, trainer.model.policy) > 0
    logs = [entry for entry in trainer.state.log_history if M.POLICY_LOSS in entry]
    assert len(logs) == trainer.args.num_total_batches and all(M.SCORES in entry for entry in logs)


def test_continuous_batching_with_vllm_is_refused_and_its_config_may_be_json(tmp_path):
    with pytest.raises(ValueError, match="two generation engines"):
        PPOMaxConfig(output_dir=str(tmp_path), use_vllm=True, use_transformers_continuous_batching=True)
    config = PPOMaxConfig(output_dir=str(tmp_path), transformers_continuous_batching_config='{"num_blocks": 32}')
    assert config.transformers_continuous_batching_config == {"num_blocks": 32}
