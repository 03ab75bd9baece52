"""Train a PPO-max reward model: pairwise loss + imitation (LM) loss on the chosen response (§3.1 of the paper).

    trl-ppomax reward --config reward_tiny_cpu      # trl_ppomax/cli/configs/reward_tiny_cpu.yaml
    trl-ppomax reward --config reward_moss_7b_en --accelerate_config zero2
    # from a repository checkout: a tiny CPU run (build the tiny models first), the paper's setting
    trl-ppomax tiny tiny
    accelerate launch recipes/reward_modeling.py --config recipes/configs/reward_tiny_cpu.yaml
    accelerate launch --config_file recipes/accelerate/deepspeed_zero2.yaml recipes/reward_modeling.py \
        --config recipes/configs/reward_moss_7b_en.yaml

Any config field can be overridden on the command line (`--learning_rate 1e-5`). The dataset is a Hub id, a local
folder, or a local .json/.jsonl/.parquet/.csv file, in any trl preference format; raw HH-RLHF rows
(`chosen`/`rejected` dialogues with "\\n\\nHuman:" turns) are converted automatically.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from accelerate import PartialState
from datasets import DatasetDict, load_dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from trl import ModelConfig, ScriptArguments, get_peft_config

from trl_ppomax.cli.arguments import model_kwargs, parse_script_args, setup_distributed
from trl_ppomax.data.hh_rlhf import convert_hh_rlhf, is_hh_rlhf
from trl_ppomax.data.sources import check_local_paths, load_data_file
from trl_ppomax.ppo.config import check_int_fields
from trl_ppomax.reward_modeling.config import PPOMaxRewardConfig
from trl_ppomax.reward_modeling.trainer import PPOMaxRewardTrainer

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class RewardScriptArguments(ScriptArguments):
    """Where the preferences come from (trl's `ScriptArguments`), and optional tiny offline models."""

    tiny_models_dir: str | None = field(
        default=None,
        metadata={"help": "Build tiny offline models and datasets here (trl-ppomax tiny) if the folder is missing."},
    )

    def __post_init__(self) -> None:
        check_int_fields(self)
        getattr(super(), "__post_init__", lambda: None)()


def load_preferences(script_args: ScriptArguments) -> DatasetDict:
    """A DatasetDict from a Hub id, a folder, or a single data file (which becomes the 'train' split)."""
    name = script_args.dataset_name
    if os.path.isfile(name) and os.path.splitext(name)[1] in FILE_BUILDERS:
        dataset = DatasetDict({"train": load_data_file(name)})  # an empty or broken file is named
    else:
        dataset = load_dataset(name, name=script_args.dataset_config)
    if is_hh_rlhf(dataset[script_args.dataset_train_split]):
        dataset = DatasetDict({split: convert_hh_rlhf(part) for split, part in dataset.items()})
    return dataset


def load_model(model_args: ModelConfig, training_args: PPOMaxRewardConfig):
    """The causal LM (imitation loss on) or a one-label sequence classifier (lm_loss_coef = 0)."""
    kwargs = model_kwargs(model_args)
    if training_args.lm_loss_coef > 0:
        return AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, **kwargs)
    return AutoModelForSequenceClassification.from_pretrained(model_args.model_name_or_path, num_labels=1, **kwargs)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Train with the settings of ``argv`` (default: the command line); ``prog`` names the command in its help and
    errors (default: the script's file name)."""
    script_args, training_args, model_args = parse_script_args(
        (RewardScriptArguments, PPOMaxRewardConfig, ModelConfig), argv, prog
    )
    check_local_paths({"model_name_or_path": model_args.model_name_or_path, "dataset_name": script_args.dataset_name})
    setup_distributed(training_args)  # before the model: ZeRO-3 builds it inside zero.Init
    with PartialState().local_main_process_first():  # the data first: an empty or broken file fails before the model
        dataset = load_preferences(script_args)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    eval_dataset = None
    if training_args.eval_strategy != "no":
        if script_args.dataset_test_split not in dataset:
            dataset = dataset[script_args.dataset_train_split].train_test_split(test_size=0.1, seed=training_args.seed)
            dataset = DatasetDict({script_args.dataset_train_split: dataset["train"], "test": dataset["test"]})
        eval_dataset = dataset[script_args.dataset_test_split if script_args.dataset_test_split in dataset else "test"]

    trainer = PPOMaxRewardTrainer(
        model=load_model(model_args, training_args),
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)


if __name__ == "__main__":
    main()
