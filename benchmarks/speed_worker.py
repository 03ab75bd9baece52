"""One timed PPO run for benchmarks/speed.py, with either trl 1.12's PPOTrainer or PPOMaxTrainer, on identical work.

Runs in the trl 1.12 virtual environment (``--impl trl112``) or in the project's (``--impl ppomax``); prints one JSON
line: training-loop time, episodes per second, the time split by phase, and the peak resident memory (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from contextlib import contextmanager

import torch
from datasets import load_from_disk
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

PHASES: dict[str, float] = {}


@contextmanager
def timed(phase: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        PHASES[phase] = PHASES.get(phase, 0.0) + time.perf_counter() - start


def wrap(owner, name: str, phase: str, no_grad_only: bool = False) -> None:
    """Time calls of ``owner.name`` as ``phase`` (only those made without autograd, i.e. in the rollout, when
    ``no_grad_only``: the same functions also run the training forward)."""
    original = getattr(owner, name)

    def timed_call(*args, **kwargs):
        if no_grad_only and torch.is_grad_enabled():
            return original(*args, **kwargs)
        with timed(phase):
            return original(*args, **kwargs)

    setattr(owner, name, timed_call)


def instrument(impl: str) -> None:
    """Time generation and the no-grad scoring forwards inside each trainer (the rest of train() is the update)."""
    if impl == "trl112":
        import trl.experimental.ppo.ppo_trainer as module

        wrap(module, "batch_generation", "generation")
        wrap(module, "forward", "scoring_forwards", no_grad_only=True)  # reference log-probs
        wrap(module, "get_reward", "scoring_forwards", no_grad_only=True)  # values and scores
    else:
        import trl_ppomax.generation as generation
        import trl_ppomax.models as modeling
        import trl_ppomax.rewards as rewards

        wrap(generation, "generate_responses", "generation")
        from trl_ppomax.generation import continuous_batching

        wrap(continuous_batching.ContinuousBatchingEngine, "generate", "generation")
        if impl == "ppomax+vllm":
            import trl_ppomax.generation.vllm as engine

            wrap(engine.VLLMEngine, "generate", "generation")  # includes the weight sync, timed apart too
            wrap(engine.VLLMEngine, "sync", "weight_sync")
        from trl_ppomax.ppo.scoring import Scorer

        # the policy's and reference's log-prob forwards (their LM heads in chunks), the values, the scores
        for owner, name in ((Scorer, "log_probs"), (modeling, "token_values"), (rewards, "sequence_scores")):
            wrap(owner, name, "scoring_forwards", no_grad_only=True)


TOKENS = {"padded": 0, "real": 0}


def count_tokens() -> None:
    """Count the padded and real tokens of every forward's inputs (``sequence_inputs``: rollout forwards and update)."""
    import trl_ppomax.models as models

    original = models.sequence_inputs

    def counted(*args, **kwargs):
        inputs = original(*args, **kwargs)
        TOKENS["padded"] += inputs["input_ids"].numel()
        TOKENS["real"] += int(inputs["attention_mask"].sum())
        return inputs

    models.sequence_inputs = counted


def varied_prompts(dataset, tokenizer, seed: int = 0):
    """The prompts with a random prefix of 0–48 filler words each: widely varying prompt (and so sequence) lengths."""
    generator = torch.Generator().manual_seed(seed)
    filler = tokenizer.convert_tokens_to_ids([f"w{i}" for i in range(100, 400)])

    def prefixed(row, index):
        n = int(torch.randint(0, 49, (1,), generator=generator))
        return {"input_ids": [filler[(index * 7 + k) % len(filler)] for k in range(n)] + row["input_ids"]}

    return dataset.map(prefixed, with_indices=True)


def logged_timings(log_history: list[dict]) -> dict:
    """The trainer's own phase times summed over the run (``timing/…``, one log per iteration), in seconds: with
    ``max_staleness`` ≥ 1 generation runs in the producer thread, so the wrapped-function times above overlap."""
    names = {"rollout_phase_seconds": "timing/rollout", "update_phase_seconds": "timing/update"}
    names.update(rollout_wait_seconds="timing/rollout_wait", producer_generation_seconds="timing/generation")
    sums = {field: sum(e[name] for e in log_history if name in e) for field, name in names.items()}
    return {field: total for field, total in sums.items() if any(names[field] in e for e in log_history)}


def peak_rss_bytes() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read())[1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["trl112", "ppomax", "ppomax+vllm"], required=True)
    parser.add_argument("--preset", default="vanilla")
    parser.add_argument("--assets", required=True)
    parser.add_argument("--episodes", type=int, default=192)
    parser.add_argument("--response-length", type=int, default=48)
    parser.add_argument("--vanilla-sampling", action="store_true", help="ppomax: trl's sampling (no top-p/penalty)")
    parser.add_argument("--no-stop-token", action="store_true", help="every response is --response-length tokens")
    parser.add_argument("--samples-per-prompt", type=int, default=1, help="ppomax: num_samples_per_prompt")
    parser.add_argument("--max-tokens", type=int, default=None, help="ppomax: max_tokens_per_microbatch")
    parser.add_argument("--varied-lengths", action="store_true", help="prompts of widely varying lengths")
    parser.add_argument("--estimator", default="gae", help="ppomax: advantage_estimator (critic-free: no value model)")
    parser.add_argument("--max-staleness", type=int, default=0, help="ppomax: max_staleness (a producer thread)")
    parser.add_argument(
        "--continuous-batching", action="store_true", help="ppomax: use_transformers_continuous_batching"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.impl == "trl112":
        from trl.experimental.ppo import PPOConfig, PPOTrainer

        extra = {}
        kl_key, length_key = "objective/kl", "response/length"  # trl 1.12's names (trl_ppomax may not import here)
    else:
        from trl_ppomax import PPOMaxConfig as PPOConfig
        from trl_ppomax import PPOMaxTrainer as PPOTrainer
        from trl_ppomax.base import metrics

        kl_key, length_key = metrics.KL, metrics.RESPONSE_LENGTH
        extra = {"preset": args.preset, "temperature": 0.7}
        extra.update(num_samples_per_prompt=args.samples_per_prompt, max_tokens_per_microbatch=args.max_tokens)
        extra.update(advantage_estimator=args.estimator, max_staleness=args.max_staleness)
        if args.vanilla_sampling:
            extra.update(top_p=1.0, repetition_penalty=1.0)
        if args.impl == "ppomax+vllm":
            extra.update(use_vllm=True, vllm_gpu_memory_utilization=0.3)
        if args.continuous_batching:  # a cache sized for this run: sized from free memory, it takes seconds on a CPU
            cache = {"num_blocks": 128, "max_batch_tokens": 1024}
            extra.update(use_transformers_continuous_batching=True, transformers_continuous_batching_config=cache)
    instrument(args.impl)
    if args.impl.startswith("ppomax"):
        count_tokens()
    tokenizer = AutoTokenizer.from_pretrained(f"{args.assets}/sft", padding_side="left")
    config = PPOConfig(
        output_dir="/tmp/speed-run",
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        num_mini_batches=1,
        num_ppo_epochs=2,
        total_episodes=args.episodes,
        response_length=args.response_length,
        local_rollout_forward_batch_size=16,
        stop_token=None if args.no_stop_token else "eos",
        learning_rate=1e-5,
        num_sample_generations=0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        **extra,
    )
    critic_free = args.impl.startswith("ppomax") and not config.uses_critic
    value_model = None if critic_free else AutoModelForSequenceClassification.from_pretrained(f"{args.assets}/reward")
    prompts = load_from_disk(f"{args.assets}/prompts")
    prompts = varied_prompts(prompts, tokenizer) if args.varied_lengths else prompts
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=AutoModelForCausalLM.from_pretrained(f"{args.assets}/sft"),
        ref_model=AutoModelForCausalLM.from_pretrained(f"{args.assets}/sft"),
        reward_model=AutoModelForSequenceClassification.from_pretrained(f"{args.assets}/reward", num_labels=1),
        value_model=value_model,
        train_dataset=prompts,
    )
    PHASES.clear()
    TOKENS.update(padded=0, real=0)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    logs = [entry for entry in trainer.state.log_history if kl_key in entry]
    lengths = [entry.get(length_key) for entry in logs if length_key in entry]
    update = seconds - PHASES.get("generation", 0.0) - PHASES.get("scoring_forwards", 0.0)
    sync = PHASES.get("weight_sync", 0.0)
    print(
        "RESULT "
        + json.dumps(
            {
                "impl": args.impl,
                "estimator": args.estimator,
                "preset": (args.preset + ("+vanilla_sampling" if args.vanilla_sampling else ""))
                if args.impl.startswith("ppomax")
                else "trl112",
                "episodes": args.episodes,
                "train_seconds": seconds,
                "episodes_per_second": args.episodes / seconds,
                "generation_seconds": PHASES.get("generation", 0.0) - sync,
                "weight_sync_seconds": sync,
                "weight_sync_seconds_per_iteration": sync / len(logs) if logs else None,
                "scoring_forwards_seconds": PHASES.get("scoring_forwards", 0.0),
                "update_and_rest_seconds": update,
                "peak_rss_gb": peak_rss_bytes() / 1e9,
                "mean_response_length": sum(lengths) / len(lengths) if lengths else None,
                "padded_tokens": TOKENS["padded"] or None,
                "padding_share": 1 - TOKENS["real"] / TOKENS["padded"] if TOKENS["padded"] else None,
                **logged_timings(trainer.state.log_history),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
