"""TRL's PPO example workload, run the way a user runs it, with trl 1.12's PPOTrainer or PPOMaxTrainer.

The same steps as ``examples/scripts/ppo/ppo.py`` in huggingface/trl: one ``HfArgumentParser`` over (ScriptArguments,
PPOConfig, ModelConfig); a left-padding tokenizer with a pad token; value and reward models from the reward path, policy
and reference from the SFT path; the ``prompt`` column tokenized with ``dataset.map``; the last 100 rows held out for
evaluation; then ``train()``, ``save_model()`` and ``generate_completions()``. ``--impl`` picks the import; every other
argument goes to the parser, so each trainer runs with its own config defaults unless told otherwise.

    python benchmarks/example_script_worker.py --impl ppomax --dataset_name DIR --model_name_or_path SFT \\
        --sft_model_path SFT --reward_model_path RM --total_episodes 320 --output_dir OUT --report_to none

Prints one ``RESULT`` JSON line at exit: seconds per phase and the peak resident memory (VmHWM).
"""

from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402

from datasets import load_dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    HfArgumentParser,
)
from trl import ModelConfig, ScriptArguments  # noqa: E402

EVAL_ROWS = 100
#: Logged measures of the rollouts' lengths, averaged over the run when the trainer logs them (trl 1.12 logs the eos
#: count, PPO-max the mean response length).
LENGTH_KEYS = {"response/length": "mean_response_length", "val/num_eos_tokens": "mean_eos_tokens_per_batch"}


def trainer_classes(impl: str):
    """``(PPOConfig, PPOTrainer)``: trl 1.12's experimental PPO, or PPO-max under the same names."""
    if impl == "trl112":
        from trl.experimental.ppo import PPOConfig, PPOTrainer
    else:
        from trl_ppomax import PPOMaxConfig as PPOConfig
        from trl_ppomax import PPOMaxTrainer as PPOTrainer
    return PPOConfig, PPOTrainer


def peak_rss_gb() -> float:
    with open("/proc/self/status") as status:
        return int(re.search(r"VmHWM:\s+(\d+)", status.read())[1]) * 1024 / 1e9


def main() -> None:
    selector = argparse.ArgumentParser(add_help=False)
    selector.add_argument("--impl", choices=["trl112", "ppomax"], required=True)
    choice, rest = selector.parse_known_args()
    PPOConfig, PPOTrainer = trainer_classes(choice.impl)
    phases = {"import_seconds": time.perf_counter() - START}

    mark = time.perf_counter()
    parser = HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_into_dataclasses(args=rest)
    shutil.rmtree(training_args.output_dir, ignore_errors=True)

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, padding_side="left")
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    value_model = AutoModelForSequenceClassification.from_pretrained(training_args.reward_model_path, num_labels=1)
    reward_model = AutoModelForSequenceClassification.from_pretrained(training_args.reward_model_path, num_labels=1)
    policy = AutoModelForCausalLM.from_pretrained(training_args.sft_model_path)
    ref_policy = AutoModelForCausalLM.from_pretrained(training_args.sft_model_path)

    dataset = load_dataset(
        script_args.dataset_name, name=script_args.dataset_config, split=script_args.dataset_train_split
    )
    split = len(dataset) - EVAL_ROWS

    def tokenized(rows):
        """Token ids of the prompts only; the trainer's collator pads each batch."""
        return rows.map(
            lambda batch: {"input_ids": tokenizer(batch["prompt"], padding=False)["input_ids"]},
            batched=True,
            remove_columns=rows.column_names,
            num_proc=training_args.dataset_num_proc,
        )

    train_dataset = tokenized(dataset.select(range(split)))
    eval_dataset = tokenized(dataset.select(range(split, len(dataset))))
    phases["setup_seconds"] = time.perf_counter() - mark

    mark = time.perf_counter()
    trainer = PPOTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
    )
    phases["init_seconds"] = time.perf_counter() - mark
    for phase, step in (
        ("train_seconds", trainer.train),
        ("save_seconds", lambda: trainer.save_model(training_args.output_dir)),
        ("completions_seconds", trainer.generate_completions),
    ):
        mark = time.perf_counter()
        step()
        phases[phase] = time.perf_counter() - mark
    phases["in_script_seconds"] = time.perf_counter() - START
    for key, name in LENGTH_KEYS.items():
        values = [entry[key] for entry in trainer.state.log_history if key in entry]
        phases[name] = sum(values) / len(values) if values else None
    result = {
        "impl": choice.impl,
        "preset": getattr(training_args, "preset", "trl112"),
        "episodes": training_args.total_episodes,
        **phases,
        "peak_rss_gb": peak_rss_gb(),
    }
    sys.stdout.flush()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
