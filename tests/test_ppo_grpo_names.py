"""TRL GRPO's config names on PPOMaxConfig (``trl_ppomax.ppo.grpo_names``): every field ``trl.GRPOConfig`` adds to
``TrainingArguments`` is named once in the table, taken with TRL's meaning or refused by name; TRL's defaults written
out pass; the aliases read back the run's values; the guide's table is the code's; ``max_steps``; what a GRPO script
gets that a PPO-max script does not."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import TrainingArguments

from trl_ppomax import PPOMaxConfig as GRPOConfig
from trl_ppomax.ppo import grpo_names

trl = pytest.importorskip("trl")


def trl_fields() -> dict[str, dataclasses.Field]:
    """The fields the installed ``trl.GRPOConfig`` adds to ``TrainingArguments``."""
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {f.name: f for f in dataclasses.fields(trl.GRPOConfig) if f.name not in inherited}


BATCH = dict(output_dir="unused", report_to="none", per_device_train_batch_size=4)


#: For each mapped or accepted field: a value a GRPO script sets, and what it must do here.
EFFECTS = {
    "num_generations": (4, lambda c: c.num_samples_per_prompt == 4),
    "max_completion_length": (32, lambda c: c.response_length == 32 and c.max_completion_tokens == 32),
    "generation_batch_size": (8, lambda c: c.num_mini_batches == 2),
    "steps_per_generation": (2, lambda c: c.num_mini_batches == 2),
    "beta": (
        0.04,
        lambda c: (
            (c.kl_coef, c.kl_placement, c.kl_estimator, c.kl_loss_importance_weighted) == (0.04, "loss", "k3", True)
        ),
    ),
    "use_bias_correction_kl": (True, lambda c: not c.kl_loss_importance_weighted),  # said, not applied, without beta
    "num_iterations": (2, lambda c: c.num_ppo_epochs == 2),
    "epsilon": (0.3, lambda c: c.cliprange == 0.3),
    "epsilon_high": (0.28, lambda c: c.cliprange_high == 0.28),
    "delta": (4.0, lambda c: c.dual_clip == 4.0),
    "scale_rewards": ("batch", lambda c: c.advantage_estimator == "gae"),  # said, not applied, under GAE
    "loss_type": ("dr_grpo", lambda c: c.loss_aggregation == "seq_mean_token_sum_norm"),
    "max_tool_calling_iterations": (3, lambda c: c.max_tool_turns == 3),
    "model_init_kwargs": ('{"dtype": "float32"}', lambda c: c.model_init_kwargs == {"dtype": "float32"}),
    "trust_remote_code": (True, lambda c: c.trust_remote_code),
    "disable_dropout": (True, lambda c: c.disable_dropout),
    "shuffle_dataset": (True, lambda c: c.shuffle_dataset),
    "top_k": (50, lambda c: c.top_k == 50),
    "min_p": (0.05, lambda c: c.min_p == 0.05),
    "generation_kwargs": ({"suppress_tokens": [7]}, lambda c: c.generation_kwargs == {"suppress_tokens": [7]}),
    "chat_template_kwargs": (
        {"enable_thinking": False},
        lambda c: c.chat_template_kwargs == {"enable_thinking": False},
    ),
    "cache_implementation": ("static", lambda c: c.cache_implementation == "static"),
    "mask_truncated_completions": (True, lambda c: c.mask_truncated_completions),
    "log_completions": (True, lambda c: c.log_completions),
    "num_completions_to_print": (2, lambda c: c.num_completions_to_print == 2),
    "log_multimodal": (False, lambda c: c.log_multimodal is False),
}


#: For each refused field: a value TRL accepts that is not offered here.
REFUSED = {
    "router_aux_loss_coef": 0.001, "cast_lm_head_to_fp32": True, "num_generations_eval": 2, "pad_to_multiple_of": 64,
    "vllm_structured_outputs_regex": "a+", "sapo_temperature_neg": 2.0, "sapo_temperature_pos": 2.0,
    "vespo_k_pos": 1.0, "vespo_lambda_pos": 1.0, "vespo_k_neg": 1.0, "vespo_lambda_neg": 1.0,
    "importance_sampling_level": "sequence", "multi_objective_aggregation": "normalize_then_sum",
    "sync_ref_model": True, "ref_model_mixup_alpha": 0.9, "ref_model_sync_steps": 64, "top_entropy_quantile": 0.2,
    "use_adaptive_entropy": True, "entropy_coef_min": 0.1, "entropy_coef_max": 0.5, "entropy_coef_delta": 0.01,
    "vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_min": 0.5,
    "off_policy_mask_threshold": 0.5, "log_unique_prompts": True, "log_completions_hub_repo": "me/completions",
    "use_transformers_continuous_batching": True, "transformers_continuous_batching_config": {"a": 1},
    "use_transformers_paged": True, "vllm_importance_sampling_cap": 2.0,
}  # fmt: skip


def test_the_table_names_every_field_of_the_installed_grpo_config_once():
    names = [entry.name for entry in grpo_names.GRPO_NAMES]
    assert len(names) == len(set(names)) and set(names) == set(trl_fields())
    ours = {f.name for f in dataclasses.fields(GRPOConfig)}
    assert all(entry.name in ours for entry in grpo_names.GRPO_NAMES)  # the command line parses every one


def test_the_guides_table_is_the_codes():
    from pathlib import Path

    guide = Path(__file__).resolve().parents[1] / "docs" / "grpo-swap-in.md"
    assert grpo_names.render_table() in guide.read_text()


@pytest.mark.parametrize("name", sorted(trl_fields()))
def test_every_grpo_config_field_is_taken_with_trls_meaning_or_refused_by_name(name):
    entry = grpo_names.BY_NAME[name]
    if entry.how == "same":  # ours already: the field is PPOMaxConfig's own, not a GRPO alias
        assert name not in grpo_names.GRPO_ONLY and name in {f.name for f in dataclasses.fields(GRPOConfig)}
        return
    if entry.how == "refused":
        extra = {"use_vllm": True} if name.startswith("vllm_") else {}  # vLLM's settings act only with vLLM
        with pytest.raises(ValueError, match=rf"^{name}=.*\(TRL GRPOConfig's\) is not supported: .* Remove it"):
            GRPOConfig(**BATCH, **extra, **{name: REFUSED[name]})
        GRPOConfig(**BATCH, **extra, **{name: entry.accepted})  # the value that changes nothing passes
        return
    value, effect = EFFECTS[name]
    assert effect(GRPOConfig(**BATCH, **{name: value})), f"{name}={value!r} did not act"


def test_a_config_with_every_trl_default_written_out_is_accepted():
    """A script that spells out GRPOConfig's defaults (as a YAML dump of one does) is not refused."""
    defaults = {}
    for name, f in trl_fields().items():
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if name not in ("generation_batch_size", "steps_per_generation"):  # TRL refuses both set too
            defaults[name] = default
    config = GRPOConfig(output_dir="unused", report_to="none", per_device_train_batch_size=8, **defaults)
    assert (config.num_samples_per_prompt, config.response_length, config.loss_aggregation) == (
        8,
        512,
        "minibatch_token_mean",
    )
    assert config.kl_placement == "loss" and config.kl_coef == 0.0  # beta=0.0 written out: TRL's "no KL"


def test_trl_names_beside_ours_with_another_value_are_refused_and_equal_ones_pass():
    with pytest.raises(ValueError, match=r"num_generations=4 \(TRL's name\) sets num_samples_per_prompt=4.*keep one"):
        GRPOConfig(**BATCH, num_generations=4, num_samples_per_prompt=2)
    assert GRPOConfig(**BATCH, num_generations=4, num_samples_per_prompt=4).num_samples_per_prompt == 4
    with pytest.raises(ValueError, match="generation_batch_size and steps_per_generation both set"):
        GRPOConfig(**BATCH, generation_batch_size=8, steps_per_generation=2)
    with pytest.raises(ValueError, match="steps_per_generation=3 must be a multiple of 2"):
        GRPOConfig(**BATCH, gradient_accumulation_steps=2, steps_per_generation=3)
    with pytest.raises(ValueError, match="loss_type='cispo'"):
        GRPOConfig(**BATCH, loss_type="cispo")


def test_scale_rewards_gives_trls_group_estimator_and_epsilon():
    group = GRPOConfig(**BATCH, advantage_estimator="grpo", num_generations=4, scale_rewards=True)
    assert (group.advantage_estimator, group.group_scale, group.group_std_eps) == ("grpo", "group", 1e-4)
    none = GRPOConfig(**BATCH, advantage_estimator="grpo", num_generations=4, scale_rewards="none")
    assert none.advantage_estimator == "dr_grpo"
    batch = GRPOConfig(**BATCH, advantage_estimator="grpo", num_generations=4, scale_rewards="batch")
    assert batch.group_scale == "batch"
    plain = GRPOConfig(**BATCH, advantage_estimator="grpo", num_generations=4)  # ours, unchanged: verl's ε
    assert (plain.group_scale, plain.group_std_eps) == ("group", 1e-6)


def test_the_aliases_read_back_the_runs_values_and_a_config_rebuilt_from_them_is_the_same():
    config = GRPOConfig(**BATCH, num_generations=2, gradient_accumulation_steps=2)
    assert (config.num_generations, config.max_completion_length, config.num_iterations) == (2, 53, 4)
    assert config.steps_per_generation == 2 and config.grpo_swap_notice.startswith("A TRL GRPO script")
    again = GRPOConfig(**{**BATCH, **{k: v for k, v in config.to_dict().items() if k in grpo_names.GRPO_ONLY}})
    assert again.num_samples_per_prompt == 2 and again.response_length == 53
    assert GRPOConfig(**BATCH).grpo_swap_notice is None  # a PPO-max script is told nothing


def test_max_steps_is_the_number_of_iterations():
    config = GRPOConfig(**BATCH, max_steps=5)
    config.set_run_length(100)
    assert (config.num_total_batches, config.total_episodes) == (5, 20)
    with pytest.raises(ValueError, match=r"max_steps=5 .* and total_episodes=8 disagree"):
        GRPOConfig(**BATCH, max_steps=5, total_episodes=8).set_run_length(100)
    plain = GRPOConfig(**BATCH)
    plain.set_run_length(8)
    assert plain.num_total_batches == 6  # num_train_epochs=3 of 8 prompts, 4 a batch


def test_a_grpo_script_gets_trls_sample_and_malformed_call_behaviour_a_ppo_max_script_keeps_its_own():
    grpo, ours = GRPOConfig(**BATCH, num_generations=4), GRPOConfig(**BATCH)
    assert (grpo.num_sample_generations, grpo.malformed_tool_calls) == (0, "ignore")
    assert (ours.num_sample_generations, ours.malformed_tool_calls) == (10, "feedback")
    kept = GRPOConfig(**BATCH, num_generations=4, num_sample_generations=3, malformed_tool_calls="feedback")
    assert (kept.num_sample_generations, kept.malformed_tool_calls) == (3, "feedback")
    assert "no sample tables" in grpo.grpo_swap_notice
    with pytest.raises(ValueError, match="malformed_tool_calls must be one of"):
        GRPOConfig(**BATCH, malformed_tool_calls="drop")
