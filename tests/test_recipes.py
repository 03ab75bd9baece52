"""The recipes run end to end on the tiny CPU configs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForSequenceClassification

from trl_ppomax.tiny import save_tiny_models

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def run_recipe(script: str, config: str, cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "WANDB_DISABLED": "true"}
    command = [sys.executable, str(RECIPES / script), "--config", str(RECIPES / "configs" / config), *overrides]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        pytest.fail(result.stderr[-4000:])
    return result


def test_reward_modeling_recipe_on_the_tiny_config(tmp_path):
    save_tiny_models(tmp_path / "tiny")
    run_recipe("reward_modeling.py", "reward_tiny_cpu.yaml", tmp_path, "--num_train_epochs", "1")
    output = tmp_path / "output" / "reward-tiny"
    model = AutoModelForSequenceClassification.from_pretrained(output)
    assert model.config.num_labels == 1 and isinstance(model.config.reward_std, float)
    assert (output / "reward_margin_histogram.png").exists()


@pytest.mark.parametrize("config", sorted(p.name for p in (RECIPES / "configs").glob("reward_*.yaml")))
def test_reward_configs_parse(config, tmp_path):
    from trl import ModelConfig, ScriptArguments, TrlParser

    from trl_ppomax import PPOMaxRewardConfig

    parser = TrlParser((ScriptArguments, PPOMaxRewardConfig, ModelConfig))
    path = str(RECIPES / "configs" / config)
    script_args, training_args, model_args = parser.parse_args_and_config(
        ["--config", path, "--bf16", "False", "--output_dir", str(tmp_path)]
    )
    assert script_args.dataset_name and model_args.model_name_or_path
    assert training_args.lm_loss_coef == 1.0
    assert Path(path).read_text().startswith("#"), "each config starts with a comment header"
