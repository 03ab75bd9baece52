"""Swap-in acceptance test (issue 2): TRL 1.12's PPO example script, with only its trainer import changed, runs
end to end on tiny local models and leaves a loadable, trained policy and its tokenizer in ``output_dir``."""

from __future__ import annotations

import ast
import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_ppomax.toyworld.tiny import ARCHITECTURES

SCRIPT = Path(__file__).parent / "scripts" / "ppo_trl112_style.py"


def run_script(paths: dict, use_peft: bool, output_dir: Path, monkeypatch, capsys) -> str:
    """TRL 1.12's example on ``paths`` (``sft``, ``reward``, ``prompts`` folders), run as ``python ppo.py ...`` runs
    it (``__main__``, its own ``sys.argv``) but in this process; returns what it printed."""
    args = [
        "--model_name_or_path", paths["sft"],
        "--sft_model_path", paths["sft"],
        "--reward_model_path", paths["reward"],
        "--dataset_name", paths["prompts"],
        "--dataset_train_split", "train",
        "--per_device_train_batch_size", "4",
        "--gradient_accumulation_steps", "1",
        "--num_mini_batches", "1",
        "--total_episodes", "16",
        "--response_length", "8",
        "--num_ppo_epochs", "1",
        "--learning_rate", "1e-3",
        "--critic_warmup_steps", "0",
        "--missing_eos_penalty", "1.0",
        "--stop_token", "eos",
        "--report_to", "none",
        "--save_strategy", "no",
        "--num_sample_generations", "0",
        "--logging_steps", "1",
        "--gradient_checkpointing", "False",
        "--disable_tqdm", "True",
        "--output_dir", str(output_dir),
    ]  # fmt: skip
    if use_peft:
        args += ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "all-linear"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    capsys.readouterr()
    runpy.run_path(str(SCRIPT), run_name="__main__")
    return capsys.readouterr().out


def logged_metrics(stdout: str) -> list[dict]:
    """The log dicts that transformers' PrinterCallback printed (``--disable_tqdm True``), one per line."""
    logs = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{") and "'objective/kl'" in line:
            logs.append(ast.literal_eval(line))
    return logs


def test_script_differs_from_trl112_only_in_the_trainer_import():
    source = SCRIPT.read_text()
    code = [line for line in source.splitlines() if not line.lstrip().startswith("#")]
    imports = [line for line in code if "import" in line and ("trl_ppomax" in line or "PPO" in line)]
    assert imports == ["from trl_ppomax import PPOMaxConfig as PPOConfig, PPOMaxTrainer as PPOTrainer"]
    assert "PPOTrainer(\n        args=training_args," in source


@pytest.mark.parametrize("use_peft", [False, True], ids=["full", "peft"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_trl112_script_runs_unchanged(user_folders, tmp_path, monkeypatch, capsys, arch, use_peft):
    """On the folders trl.SFTTrainer and trl.RewardTrainer wrote, whose tokenizer has one token fewer than the
    script's once it adds [PAD] (ids all the same, the embedding with room for it)."""
    output_dir = tmp_path / "out"
    stdout = run_script(user_folders[arch], use_peft, output_dir, monkeypatch, capsys)

    # Metrics were logged at every iteration (16 episodes / batch 4 = 4 iterations, logging_steps=1).
    logs = logged_metrics(stdout)
    assert len(logs) == 4, stdout[-4000:]
    for log in logs:
        for name in ("objective/kl", "objective/scores", "loss/policy", "loss/value", "policy/entropy"):
            assert name in log, f"{name} missing from {log}"
            assert torch.isfinite(torch.tensor(float(log[name]))), f"{name}={log[name]}"
    assert [int(float(log["episode"])) for log in logs] == [4, 8, 12, 16]

    # The tokenizer was saved with the policy.
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert tokenizer.pad_token == "[PAD]"

    sft = AutoModelForCausalLM.from_pretrained(user_folders[arch]["sft"])
    sft_state = sft.state_dict()
    if not use_peft:
        assert not (output_dir / "adapter_config.json").exists()
        policy = AutoModelForCausalLM.from_pretrained(output_dir)
        assert type(policy) is type(sft)
        state = policy.state_dict()
        assert state.keys() == sft_state.keys()
        changed = [name for name in state if not torch.equal(state[name], sft_state[name])]
        assert changed, "no policy parameter changed during training"
    else:
        from peft import AutoPeftModelForCausalLM

        adapter_config = json.loads((output_dir / "adapter_config.json").read_text())
        assert adapter_config["base_model_name_or_path"] == user_folders[arch]["sft"]
        assert adapter_config["r"] == 4
        # LoRA targets the policy's linear layers only (no critic / score head, nothing fully fine-tuned).
        assert adapter_config["modules_to_save"] is None
        assert "score" not in adapter_config["target_modules"]
        assert "lm_head" not in adapter_config["target_modules"]
        assert not (output_dir / "model.safetensors").exists(), "a PEFT run must save only the adapter"
        policy = AutoPeftModelForCausalLM.from_pretrained(output_dir)
        lora_b = {name: p for name, p in policy.named_parameters() if "lora_B" in name}
        assert lora_b, "the loaded model has no LoRA weights"
        trained = [name for name, p in lora_b.items() if p.detach().abs().sum() > 0]
        assert trained, "every lora_B is still zero: the adapter was not trained"
        # Only the policy carries LoRA (the critic is a separate, fully trained model and is not saved here); the
        # base weights under the adapter are the SFT model's, untouched.
        base = {k.replace(".base_layer", ""): v for k, v in policy.get_base_model().state_dict().items()}
        for name, tensor in sft_state.items():
            assert torch.equal(base[name], tensor), f"base weight {name} changed under LoRA"
