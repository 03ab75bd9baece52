"""The recipes run end to end on the tiny CPU configs."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from trl_ppomax.toyworld.tiny import save_tiny_models

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def run_recipe(script: str, config: str, cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "WANDB_DISABLED": "true"}
    command = [sys.executable, str(RECIPES / script), "--config", str(RECIPES / "configs" / config), *overrides]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        pytest.fail(result.stderr[-4000:])
    return result


@pytest.mark.slow  # the recipe in its own process: 10 s cold (.ci/run runs it)
def test_reward_modeling_recipe_on_the_tiny_config(tmp_path):
    save_tiny_models(tmp_path / "tiny")
    run_recipe("reward_modeling.py", "reward_tiny_cpu.yaml", tmp_path, "--num_train_epochs", "1")
    output = tmp_path / "output" / "reward-tiny"
    model = AutoModelForSequenceClassification.from_pretrained(output)
    assert model.config.num_labels == 1 and isinstance(model.config.reward_std, float)
    assert (output / "reward_margin_histogram.png").exists()


def ppo_recipe():
    spec = importlib.util.spec_from_file_location("ppo_max_recipe", RECIPES / "ppo_max.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "config", sorted(p.name for p in (RECIPES / "configs").glob("*.yaml") if "reward" not in p.name)
)
def test_ppo_configs_parse_and_validate(config, tmp_path):
    from trl import ModelConfig, TrlParser

    from trl_ppomax import PPOMaxConfig

    recipe = ppo_recipe()
    parser = TrlParser((recipe.PPOMaxScriptArguments, PPOMaxConfig, ModelConfig))
    path = str(RECIPES / "configs" / config)
    script_args, training_args, model_args = parser.parse_args_and_config(
        ["--config", path, "--bf16", "False", "--output_dir", str(tmp_path)]
    )
    recipe.check_combination(script_args, training_args, model_args)
    assert training_args.batch_size >= training_args.mini_batch_size >= 1
    assert (training_args.sft_model_path or model_args.model_name_or_path) and training_args.reward_model_path
    header = Path(path).read_text().splitlines()[:3]
    assert all(line.startswith("#") for line in header), "each config starts with a comment header"


def parse_ppo_config(name: str, output_dir) -> tuple:
    from trl import ModelConfig, TrlParser

    from trl_ppomax import PPOMaxConfig

    parser = TrlParser((ppo_recipe().PPOMaxScriptArguments, PPOMaxConfig, ModelConfig))
    path = str(RECIPES / "configs" / name)
    return parser.parse_args_and_config(["--config", path, "--bf16", "False", "--output_dir", str(output_dir)])


def test_moss_configs_reproduce_the_paper_batches(tmp_path):
    _, args, _ = parse_ppo_config("moss_7b_en.yaml", tmp_path)
    # On 8 GPUs: rollout batch 128, train (mini) batch 32, as in the paper.
    assert args.local_batch_size * 8 == 128 and args.local_mini_batch_size * 8 == 32


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_moss_configs_follow_section_5_4(tmp_path, lang):
    script_args, args, _ = parse_ppo_config(f"moss_7b_{lang}.yaml", tmp_path)
    assert not args.whiten_advantages and args.advantage_clip is None  # Fig. 5, App. B.1
    assert args.lam == 0.9 and args.gamma == 1.0  # App. C.3
    assert args.learning_rate == 5e-7 and args.critic_learning_rate == 1.65e-6  # §5.1
    # critic pre-training instead of the LR warm-up (§5.3.3)
    assert args.critic_warmup_steps > 0 and args.warmup_steps == 0 and args.lr_scheduler_type == "constant"
    assert args.eval_do_sample and (args.temperature, args.top_p, args.repetition_penalty) == (0.8, 0.9, 1.1)
    assert args.ptx_coef > 0 and script_args.ptx_dataset_name  # PPO-ptx is part of PPO-max (§5.4)
    assert args.critic_adam_epsilon == 1e-8 and args.adam_epsilon == 1e-6  # the release's
    assert args.reward_norm == "running" and args.reward_clip and args.max_grad_norm > 0 and args.cliprange_value


@pytest.mark.parametrize("config", sorted(p.name for p in (RECIPES / "accelerate").glob("*.yaml")))
def test_accelerate_configs_load(config):
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(RECIPES / "accelerate" / config))
    on_cpu = config.endswith("_cpu.yaml")  # CPU processes train in fp32
    assert loaded.num_processes >= 1 and loaded.mixed_precision == ("no" if on_cpu else "bf16")
    assert loaded.use_cpu == on_cpu
    assert (RECIPES / "accelerate" / config).read_text().startswith("#")


def run_ppo_recipe(cwd: Path, *launcher: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "WANDB_DISABLED": "true"}
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *launcher,
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(RECIPES / "ppo_max.py"),
        "--config",
        str(RECIPES / "configs" / "tiny_cpu.yaml"),
        "--disable_tqdm",
        "True",
    ]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        pytest.fail(result.stderr[-4000:])
    return result.stdout


@pytest.mark.parametrize(
    "processes",
    [pytest.param(n, marks=pytest.mark.slow) for n in (1, 2)],  # 15 s and 25 s cold; .ci/run runs them
)
def test_ppo_recipe_runs_the_tiny_config(tmp_path, processes):
    launcher = ["--num_processes", "1"] if processes == 1 else ["--multi_gpu", "--num_processes", "2"]
    stdout = run_ppo_recipe(tmp_path, *launcher)
    assert f"devices   : {processes} × cpu" in stdout  # the plan
    assert "'objective/kl'" in stdout and "'eval_objective/scores'" in stdout  # training and evaluation logs
    output = tmp_path / "output" / "ppo-max-tiny"
    assert AutoModelForCausalLM.from_pretrained(output).config.model_type == "llama"
    assert (tmp_path / "tiny" / "sft").is_dir()  # built on first use


@pytest.mark.parametrize("config", sorted(p.name for p in (RECIPES / "configs").glob("reward_*.yaml")))
def test_reward_configs_parse(config, tmp_path):
    from trl import ModelConfig, TrlParser

    from trl_ppomax import PPOMaxRewardConfig
    from trl_ppomax.cli.reward import RewardScriptArguments

    parser = TrlParser((RewardScriptArguments, PPOMaxRewardConfig, ModelConfig))
    path = str(RECIPES / "configs" / config)
    script_args, training_args, model_args = parser.parse_args_and_config(
        ["--config", path, "--bf16", "False", "--output_dir", str(tmp_path)]
    )
    assert script_args.dataset_name and model_args.model_name_or_path
    assert training_args.lm_loss_coef == 1.0
    assert Path(path).read_text().startswith("#"), "each config starts with a comment header"
