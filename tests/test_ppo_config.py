"""PPOMaxConfig (``trl_ppomax.ppo.config``): whole-number fields refuse floats when the config is built, the configs'
help renders and they build without deprecation warnings, and what the config says about the run's length (a critic
warm-up as long as the run, total_episodes rounded up to whole batches)."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest
from helpers import CPU, exit_code, make_trainer
from transformers import HfArgumentParser

from trl_ppomax import PPOMaxConfig, PPOMaxRewardConfig
from trl_ppomax.ppo.config import int_fields


def test_a_critic_warmup_as_long_as_the_run_is_said_loudly(tmp_path, caplog):
    """Issue 26, bad 6: the policy never moved, and nothing said so."""
    with caplog.at_level(logging.WARNING, logger="trl_ppomax.ppo.config"):
        make_trainer(tmp_path, critic_warmup_steps=2)
    assert (
        "critic_warmup_steps=2 is not below the run's 2 iterations (total_episodes=32 ÷ batch_size=16" in caplog.text
    )
    assert "the policy will not change" in caplog.text


@pytest.mark.parametrize(("total", "rounded"), [(20, True), (32, False)])
def test_total_episodes_rounded_up_to_whole_batches_is_said(tmp_path, caplog, total, rounded):
    with caplog.at_level(logging.WARNING, logger="trl_ppomax.ppo.config"):
        trainer = make_trainer(tmp_path, total_episodes=total)
    assert trainer.args.num_total_batches == 2
    said = (
        "total_episodes=20 is not a multiple of the rollout batch, batch_size=16 (per_device_train_batch_size × "
        "gradient_accumulation_steps × num_mini_batches × processes): the run trains 2 iterations = 32 episodes, 12 "
        "more than asked. Set total_episodes to a multiple of 16 (e.g. 16 or 32)"
    )
    assert (said in caplog.text) is rounded
    assert ("not a multiple of the rollout batch" in caplog.text) is rounded


@pytest.mark.parametrize("config", [PPOMaxConfig, PPOMaxRewardConfig])
def test_hf_argument_parser_renders_the_configs_help(config, capsys):
    assert exit_code(lambda: HfArgumentParser(config).parse_args(["--help"])) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--output_dir" in out
    if config is PPOMaxConfig:
        assert "marks the assistant turns as generation blocks" in out  # the help that held "{% generation %}"


def test_a_float_sample_count_is_refused_when_the_config_is_built():
    # it used to pass, and fail at iteration 1 with "manual_seed expected a long"
    with pytest.raises(ValueError) as error:
        PPOMaxConfig(**CPU, num_samples_per_prompt=2.0)
    assert str(error.value) == (
        "num_samples_per_prompt must be a whole number, got 2.0 (a float): write num_samples_per_prompt=2 (in a YAML "
        "config `num_samples_per_prompt: 2`, without the '.0')."
    )
    with pytest.raises(ValueError, match=r"got 2\.5 \(a float\): write num_samples_per_prompt=2 or .*=3\.$"):
        PPOMaxConfig(**CPU, num_samples_per_prompt=2.5)
    with pytest.raises(ValueError, match=r"^seed must be a whole number, got True \(a bool\): write seed=1 if"):
        PPOMaxConfig(**CPU, seed=True)


@pytest.mark.parametrize("config", [PPOMaxConfig, PPOMaxRewardConfig])
def test_every_int_field_refuses_a_float_and_a_bool(config):
    names = [name for name, _ in int_fields(config)]
    assert {"per_device_train_batch_size", "seed", "gradient_accumulation_steps"} <= set(names)
    if config is PPOMaxConfig:
        assert {"num_samples_per_prompt", "response_length", "num_ppo_epochs", "critic_warmup_steps"} <= set(names)
    for name in names:
        for value in (3.0, False):
            with pytest.raises(ValueError, match=rf"^{name} must be a whole number.*got {value!r} .*write {name}="):
                config(**CPU, **{name: value})


def test_whole_numbers_still_pass_and_copies_still_build(tmp_path):
    config = PPOMaxConfig(**CPU, num_samples_per_prompt=2, max_prompt_length=None, stop_token_id=0)
    assert config.local_prompt_batch_size == config.local_batch_size // 2
    dataclasses.replace(config)  # derived sizes and what transformers set are whole numbers too
    PPOMaxRewardConfig(**CPU, max_length=64)


@pytest.mark.parametrize("config", [PPOMaxConfig, PPOMaxRewardConfig])
def test_default_configs_build_without_deprecation_warnings(config):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        built = config(**CPU)
    assert built.activation_checkpointing and built.gradient_checkpointing  # on, as in trl
