# Swap-in acceptance script (issue 2).
#
# This file follows TRL 1.12's `examples/scripts/ppo/ppo.py` step by step: same argument parsing, model and
# tokenizer loading, dataset preparation, trainer construction, training, saving and sample generation. The ONLY
# intended difference is the trainer import line:
#
#     from trl import PPOConfig, PPOTrainer                                              # trl 1.12
#     from trl_ppomax import PPOMaxConfig as PPOConfig, PPOMaxTrainer as PPOTrainer      # here
#
# Unavoidable adaptations to the current trl / transformers stack, none of which touch the trainer's API:
#   * `ModelConfig.torch_dtype` is now `ModelConfig.dtype`, and `ModelConfig.trust_remote_code` no longer exists;
#   * `trl.get_kbit_device_map` and `trl.trainer.utils.SIMPLE_CHAT_TEMPLATE` were removed, so the device map and the
#     chat template are written inline;
#   * the optional trackio reporting hooks are left out;
#   * the evaluation split is capped so that a tiny local dataset still leaves training prompts.
#
# Example (any local folder holding a `train.jsonl` with a "prompt" column works as --dataset_name):
#
#   python tests/scripts/ppo_trl112_style.py \
#       --dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style \
#       --dataset_train_split descriptiveness \
#       --learning_rate 3e-6 \
#       --output_dir pythia-1b-deduped-descriptiveness-sentiment-ppo \
#       --per_device_train_batch_size 64 \
#       --gradient_accumulation_steps 1 \
#       --total_episodes 10000 \
#       --model_name_or_path EleutherAI/pythia-1b-deduped \
#       --missing_eos_penalty 1.0

# Kept in the example's shape: the one-line trainer import (I001 would split it) and its if/else (SIM108).
# ruff: noqa: I001, SIM108

import shutil

import torch
from accelerate import PartialState
from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    HfArgumentParser,
)
from trl import (
    ModelConfig,
    ScriptArguments,
    get_peft_config,
    get_quantization_config,
)

from trl_ppomax import PPOMaxConfig as PPOConfig, PPOMaxTrainer as PPOTrainer

# The plain "role: content" chat template that trl 1.12 shipped as `SIMPLE_CHAT_TEMPLATE`.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].capitalize() + ': ' + message['content'] + '\n\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


if __name__ == "__main__":
    parser = HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_into_dataclasses()
    # start from an empty output directory
    shutil.rmtree(training_args.output_dir, ignore_errors=True)

    ################
    # Model & Tokenizer
    ################
    dtype = model_args.dtype if model_args.dtype in ["auto", None] else getattr(torch, model_args.dtype)
    quantization_config = get_quantization_config(model_args)
    # Built as in trl 1.12's example, which (like this script) did not pass it on to `from_pretrained`.
    model_kwargs = dict(
        revision=model_args.model_revision,
        attn_implementation=model_args.attn_implementation,
        dtype=dtype,
        device_map={"": PartialState().local_process_index} if quantization_config is not None else None,
        quantization_config=quantization_config,
    )

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, padding_side="left")
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    if tokenizer.chat_template is None:
        tokenizer.chat_template = CHAT_TEMPLATE
    value_model = AutoModelForSequenceClassification.from_pretrained(training_args.reward_model_path, num_labels=1)
    reward_model = AutoModelForSequenceClassification.from_pretrained(training_args.reward_model_path, num_labels=1)
    policy = AutoModelForCausalLM.from_pretrained(training_args.sft_model_path)

    peft_config = get_peft_config(model_args)
    if peft_config is None:
        ref_policy = AutoModelForCausalLM.from_pretrained(training_args.sft_model_path)
    else:
        ref_policy = None

    ################
    # Dataset
    ################
    dataset = load_dataset(
        script_args.dataset_name, name=script_args.dataset_config, split=script_args.dataset_train_split
    )
    eval_samples = min(100, len(dataset) // 5)
    train_dataset = dataset.select(range(len(dataset) - eval_samples))
    eval_dataset = dataset.select(range(len(dataset) - eval_samples, len(dataset)))
    dataset_text_field = "prompt"

    def prepare_dataset(dataset, tokenizer):
        """Tokenize the prompts once up front; the trainer only pads them into batches."""

        def tokenize(element):
            outputs = tokenizer(element[dataset_text_field], padding=False)
            return {"input_ids": outputs["input_ids"]}

        return dataset.map(
            tokenize,
            batched=True,
            remove_columns=dataset.column_names,
            num_proc=training_args.dataset_num_proc,
        )

    # Tokenize on the main process first, the other processes then read the cache.
    with PartialState().local_main_process_first():
        train_dataset = prepare_dataset(train_dataset, tokenizer)
        eval_dataset = prepare_dataset(eval_dataset, tokenizer)

    ################
    # Training
    ################
    trainer = PPOTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
    )
    trainer.train()

    # Save, and push to the Hub when asked
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)

    trainer.generate_completions()
