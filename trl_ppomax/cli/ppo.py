"""Train a policy with PPO-max: one command from a laptop CPU to many GPUs (``trl-ppomax ppo``).

    trl-ppomax ppo                                   # no arguments: the toy world demo, on a CPU in a few minutes
    trl-ppomax ppo --config tiny_cpu                 # a shipped config: trl_ppomax/cli/configs/tiny_cpu.yaml
    trl-ppomax ppo --config moss_7b_en --accelerate_config zero2
    # from a repository checkout: the toy world; two CPU processes (--multi_gpu starts torchrun, gloo on CPU); the
    # paper's English setting on 8 GPUs with DeepSpeed ZeRO-2
    accelerate launch recipes/ppo_max.py
    accelerate launch --multi_gpu --num_processes 2 recipes/ppo_max.py --config recipes/configs/tiny_cpu.yaml
    accelerate launch --config_file recipes/accelerate/deepspeed_zero2.yaml recipes/ppo_max.py \
        --config recipes/configs/moss_7b_en.yaml

Fields come from `PPOMaxScriptArguments` (below), `PPOMaxConfig` and trl's `ModelConfig`; any of them can be set in
the YAML file or on the command line (`--kl_coef 0.02`). Models: `sft_model_path` (policy and reference, or
`model_name_or_path`), `reward_model_path`, `value_model_path` (default: the reward model). Prompts: a Hub id, a
folder or a file, in trl's prompt formats, `messages` conversations, raw Anthropic HH-RLHF, or the release's data: a
JSON list of turn lists, or a folder whose `*train.json` files are the training prompts and `*valid.json` files the
evaluation prompts (unless `eval_dataset_name` says otherwise).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Literal

from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from trl import ModelConfig, ScriptArguments, get_peft_config

from trl_ppomax.cli.arguments import model_kwargs, parse_script_args, setup_distributed
from trl_ppomax.cli.plan import plan
from trl_ppomax.data.sources import check_local_paths, to_prompt_dataset
from trl_ppomax.moss import setup_tokenizer
from trl_ppomax.moss.data import load_dataset_or_release, release_files
from trl_ppomax.ppo.config import PPOMaxConfig, check_int_fields
from trl_ppomax.ppo.monitor import CollapseMonitor
from trl_ppomax.ppo.trainer import PPOMaxTrainer
from trl_ppomax.rewards import load_reward_function

logger = logging.getLogger(__name__)


@dataclass
class PPOMaxScriptArguments(ScriptArguments):
    """Where the models and prompts come from."""

    value_model_path: str | None = field(
        default=None,
        metadata={
            "help": "Critic initialisation; default: the reward model (§5.3.3). A critic-free advantage_estimator "
            "(rloo, grpo, dr_grpo, reinforce_pp, …) builds no critic and refuses it."
        },
    )
    prompt_format: Literal["auto", "moss_en", "moss_zh"] = field(
        default="auto",
        metadata={
            "help": "'auto': the tokenizer's chat template; 'moss_en'/'moss_zh': the paper's released-model format "
            "(Human:/Assistant: or <|Human|>/<|MOSS|>, joined by </s>), set on the tokenizer."
        },
    )
    eval_samples: int = field(
        default=0, metadata={"help": "Hold out this many prompts for evaluation when there is no test split."}
    )
    eval_dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Evaluation prompts from another dataset or prompt file (e.g. the release's valid.json); default: "
            "the *valid.json files of a release data folder given as dataset_name."
        },
    )
    max_train_prompts: int | None = field(default=None, metadata={"help": "Use at most this many training prompts."})
    ptx_dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Pre-training/SFT texts ('text' column), dialogues ('messages') or the release's ptx files (JSON "
            "lists of turns, the human's first) for the PPO-ptx loss (ptx_coef)."
        },
    )
    ptx_dataset_config: str | None = field(
        default=None, metadata={"help": "Configuration of the ptx dataset (e.g. 'wikitext-103-raw-v1')."}
    )
    ptx_dataset_split: str = field(default="train", metadata={"help": "Split of the ptx dataset."})
    collapse_monitor: bool = field(
        default=True,
        metadata={"help": "Watch for pattern collapse (§5.2) with trl_ppomax.ppo.monitor.CollapseMonitor."},
    )
    stop_on_collapse: bool = field(
        default=False, metadata={"help": "Stop training when the collapse monitor fires (it always warns)."}
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions added to the reward model, as dotted paths (pkg.module.fn), called as TRL's "
            "GRPO calls its reward_funcs, or http(s):// URLs of reward servers (trl_ppomax.RemoteRewardModel); "
            "weighted by reward_weights (reward model first). Default: none."
        },
    )
    tiny_models_dir: str | None = field(
        default=None,
        metadata={"help": "Build tiny offline models and datasets here (trl-ppomax tiny) if the folder is missing."},
    )

    def __post_init__(self) -> None:
        check_int_fields(self)  # eval_samples: 8.0 in a YAML config fails here, not in datasets' select
        getattr(super(), "__post_init__", lambda: None)()


def load_models(script_args, training_args: PPOMaxConfig, model_args: ModelConfig, peft_config):
    """Policy, reference (None under PEFT: the adapter is disabled instead), reward and value models (None for a
    critic-free ``advantage_estimator``, which builds no critic)."""
    kwargs = model_kwargs(model_args)
    policy_path = model_args.model_name_or_path or training_args.sft_model_path
    value_path = script_args.value_model_path or training_args.reward_model_path
    policy = AutoModelForCausalLM.from_pretrained(policy_path, **kwargs)
    reference = None if peft_config else AutoModelForCausalLM.from_pretrained(policy_path, **kwargs)
    reward = AutoModelForSequenceClassification.from_pretrained(
        training_args.reward_model_path, num_labels=1, **kwargs
    )
    value = None
    if training_args.uses_critic:
        value = AutoModelForSequenceClassification.from_pretrained(value_path, num_labels=1, **kwargs)
    return policy_path, policy, reference, reward, value


def load_tokenizer(policy_path: str, prompt_format: str):
    """The policy's tokenizer; for a MOSS format loaded with ``legacy=True``, as the release's LLaMA tokenizer
    encoded text after ``</s>`` (``moss.setup_tokenizer`` checks it)."""
    if prompt_format != "auto":
        tokenizer = AutoTokenizer.from_pretrained(policy_path, padding_side="left", legacy=True)
        return setup_tokenizer(tokenizer, lang=prompt_format.removeprefix("moss_"))
    tokenizer = AutoTokenizer.from_pretrained(policy_path, padding_side="left")
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:  # as trl's SFTTrainer and RewardTrainer pad
        logger.info("The tokenizer of %s has no pad token: padding with eos (%r).", policy_path, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.pad_token is None:
        raise ValueError(
            f"The tokenizer of {policy_path} has neither a pad nor an eos token. Give it a pad token (a dedicated "
            "token, resized embeddings) or use a MOSS prompt format, whose pad token is <unk>."
        )
    return tokenizer


def load_prompts(script_args):
    """Training and (optional) evaluation prompts: from ``eval_dataset_name``, else the ``*valid.json`` files of a
    release data folder given as ``dataset_name``, else ``eval_samples`` prompts held out of the training ones."""
    train = to_prompt_dataset(
        load_dataset_or_release(script_args.dataset_name, script_args.dataset_config, script_args.dataset_train_split)
    )
    if script_args.max_train_prompts:
        train = train.select(range(min(script_args.max_train_prompts, len(train))))
    evaluation, eval_name = None, script_args.eval_dataset_name
    if not eval_name and os.path.isdir(script_args.dataset_name) and release_files(script_args.dataset_name, "valid"):
        eval_name = script_args.dataset_name
    if eval_name:
        eval_split = "valid" if release_files(eval_name, "valid") else "train"
        evaluation = to_prompt_dataset(load_dataset_or_release(eval_name, split=eval_split))
        if script_args.eval_samples:
            evaluation = evaluation.select(range(min(script_args.eval_samples, len(evaluation))))
    elif script_args.eval_samples:
        split = train.train_test_split(test_size=script_args.eval_samples, seed=0)
        train, evaluation = split["train"], split["test"]
    return train, evaluation


def check_combination(script_args, training_args: PPOMaxConfig, model_args: ModelConfig) -> None:
    """Fail before loading anything on settings that cannot work together."""
    if not script_args.dataset_name:
        raise ValueError(
            "Set dataset_name: a Hub id, a folder, or a prompt file. (The toy world takes no other setting: "
            "`trl-ppomax ppo` alone, or with only --output_dir DIR.)"
        )
    if script_args.value_model_path and not training_args.uses_critic:
        raise ValueError(
            f"value_model_path={script_args.value_model_path!r}, but advantage_estimator="
            f"{training_args.advantage_estimator!r} needs no critic and builds none: drop value_model_path, or use "
            "advantage_estimator='gae' (with a critic)."
        )
    if training_args.ptx_coef > 0 and not script_args.ptx_dataset_name:
        raise ValueError("ptx_coef > 0 needs ptx_dataset_name (texts for the PPO-ptx loss).")
    if model_args.use_peft and script_args.value_model_path == (
        model_args.model_name_or_path or training_args.sft_model_path
    ):
        raise ValueError("value_model_path must be a sequence classifier, not the (PEFT) policy checkpoint.")
    if (model_args.load_in_4bit or model_args.load_in_8bit) and not model_args.use_peft:
        raise ValueError("A quantised policy can only be trained with LoRA: add --use_peft.")


def main(argv: list[str] | None = None, prog: str | None = None) -> PPOMaxTrainer:
    """Train with the settings of ``argv`` (default: the command line); ``prog`` names the command in its help and
    errors (default: the script's file name)."""
    script_args, training_args, model_args = parse_script_args(
        (PPOMaxScriptArguments, PPOMaxConfig, ModelConfig), argv, prog
    )
    check_combination(script_args, training_args, model_args)
    policy_setting = "model_name_or_path" if model_args.model_name_or_path else "sft_model_path"
    check_local_paths(
        {
            policy_setting: model_args.model_name_or_path or training_args.sft_model_path,
            "reward_model_path": training_args.reward_model_path,
            "value_model_path": script_args.value_model_path,
            "dataset_name": script_args.dataset_name,
            "eval_dataset_name": script_args.eval_dataset_name,
            "ptx_dataset_name": script_args.ptx_dataset_name,
        }
    )
    setup_distributed(training_args)  # before any model: ZeRO-3 builds them inside zero.Init
    with PartialState().local_main_process_first():  # the data first: an empty or broken file fails before the models
        train_prompts, eval_prompts = load_prompts(script_args)
        ptx = None
        if script_args.ptx_dataset_name:
            ptx = load_dataset_or_release(
                script_args.ptx_dataset_name,
                script_args.ptx_dataset_config,
                split=script_args.ptx_dataset_split,
                kind="ptx",
            )
    peft_config = get_peft_config(model_args)
    policy_path, policy, reference, reward, value = load_models(script_args, training_args, model_args, peft_config)
    tokenizer = load_tokenizer(policy_path, script_args.prompt_format)
    functions = [load_reward_function(path) for path in script_args.reward_funcs or []]
    trainer = PPOMaxTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=policy,
        ref_model=reference,
        reward_model=[reward, *functions] if functions else reward,
        train_dataset=train_prompts,
        value_model=value,
        eval_dataset=eval_prompts,
        peft_config=peft_config,
        ptx_dataset=ptx,
    )
    if script_args.collapse_monitor:
        CollapseMonitor(stop_training=script_args.stop_on_collapse).attach(trainer)
    if trainer.accelerator.is_main_process:
        print(plan(trainer), flush=True)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    trainer.accelerator.end_training()  # tear the process group down cleanly (ZeRO-3 could abort at exit)
    return trainer


def toy_world_arguments(argv: list[str]) -> dict | None:
    """``run_demo``'s arguments when ``argv`` asks for the toy world: nothing, or only ``--output_dir DIR`` (the
    toy world's folder); None when ``argv`` says anything else (a real run)."""
    if not argv:
        return {}
    if len(argv) == 2 and argv[0] in ("--output_dir", "--output-dir"):
        return {"output_dir": argv[1]}
    if len(argv) == 1 and argv[0].startswith(("--output_dir=", "--output-dir=")):
        return {"output_dir": argv[0].partition("=")[2]}
    return None


def run(argv: list[str] | None = None, prog: str | None = None) -> None:
    """`main`, or the toy world demo when there are no arguments or only ``--output_dir DIR`` (as
    `accelerate launch recipes/ppo_max.py`)."""
    argv = sys.argv[1:] if argv is None else argv
    demo = toy_world_arguments(argv)
    if demo is not None:
        from trl_ppomax.toyworld.demo import run_demo

        run_demo(**demo)
    else:
        main(argv, prog)


if __name__ == "__main__":
    run()
