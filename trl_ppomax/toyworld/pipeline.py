"""The whole RLHF pipeline in the toy world: SFT (trl's SFTTrainer) → preference pairs sampled from the SFT policy and
labelled by the gold function → reward model (PPOMaxRewardTrainer) → PPO (PPOMaxTrainer), with the gold reward logged
next to the proxy. The SFT policy and reward model are built and cached in :mod:`.build`; this module runs PPO on them."""

from __future__ import annotations

import os
import shutil

from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from trl_ppomax.ppo import metrics as M
from trl_ppomax.toyworld.build import QUIET, World
from trl_ppomax.toyworld.world import WorldSampler, gold_rewards


def eval_prompts(n: int = 64, seed: int = 1234) -> Dataset:
    return Dataset.from_dict({"prompt": WorldSampler(seed=seed).prompts(n, offset=3)})


def train_prompts(n: int = 2048, seed: int = 0) -> Dataset:
    return Dataset.from_dict({"prompt": WorldSampler(seed=seed).prompts(n, offset=4)})


#: The gold reward, logged next to the proxy as a ``rollout_metrics`` entry (the trainer does not log it otherwise).
GOLD_METRICS = {M.GOLD_REWARD: gold_rewards}


# PPO in the toy world. Every method samples the same way (temperature 1, no top-p, no repetition penalty), so
# that only the PPO maths differs; a repetition penalty would hide the repetition collapse the world is built to show.
SAMPLING = dict(temperature=1.0, top_p=1.0, repetition_penalty=1.0)
METHODS: dict[str, dict] = {
    "vanilla_ppo": dict(preset="vanilla", kl_coef=0.0),  # the paper's vanilla PPO: no normalisation, no KL
    # trl 1.12's PPO maths: vanilla + KL 0.05 in the reward (also the "KL only" ablation)
    "trl_ppo": dict(preset="vanilla"),
    "ppo_max": dict(preset="ppo_max"),
    "reward_norm_only": dict(preset="vanilla", kl_coef=0.0, reward_norm="running", reward_clip=10.0),
    "critic_warmup_only": dict(preset="vanilla", kl_coef=0.0, critic_warmup_steps=4),
    "ptx_only": dict(preset="vanilla", kl_coef=0.0, ptx_coef=0.5),
    # PPO-max minus one trick (the stress benchmark): each switches off exactly one of the fields in which the
    # ppo_max preset differs from vanilla, or the KL penalty, with the value the config documents as "off"
    "ppo_max_no_reward_norm": dict(preset="ppo_max", reward_norm="none"),  # the clip then bounds the raw score
    "ppo_max_no_reward_clip": dict(preset="ppo_max", reward_clip=None),
    "ppo_max_no_critic_warmup": dict(preset="ppo_max", critic_warmup_steps=0),
    "ppo_max_no_grad_clip": dict(preset="ppo_max", max_grad_norm=0.0),
    "ppo_max_no_kl": dict(preset="ppo_max", kl_coef=0.0),
    # the package's ppo_max before it followed Fig. 5: advantage whitening (trl 1.12's) and λ 0.95 on top of PPO-max
    "ppo_max_whitened": dict(preset="ppo_max", whiten_advantages=True, lam=0.95),
    # beyond the paper (issue 24): the robust preset, and it minus one of its options
    "ppo_max_robust": dict(preset="ppo_max_robust"),
    "ppo_max_robust_no_freeze": dict(preset="ppo_max_robust", reward_norm_freeze=False),
    "ppo_max_robust_no_winsorize": dict(preset="ppo_max_robust", reward_winsorize=None),
    "ppo_max_robust_no_lam_critic": dict(preset="ppo_max_robust", lam_critic=None),
    "ppo_max_robust_no_lam_alpha": dict(preset="ppo_max_robust", lam_alpha=None),
    # a check of the reward_offset_5 reading: KL-only with the critic pre-trained first (it then learns the offset)
    "trl_ppo_critic_warmup": dict(preset="vanilla", critic_warmup_steps=4),
    # the 2026 toolbox (issue 33) on PPO-max's reward shaping: critic-free estimators (4 samples per prompt), the KL
    # as a k2 loss, clip-higher
    "rloo": dict(preset="ppo_max", advantage_estimator="rloo", num_samples_per_prompt=4),
    "reinforce_pp_baseline": dict(
        preset="ppo_max", advantage_estimator="reinforce_pp_baseline", num_samples_per_prompt=4
    ),
    "grpo": dict(
        preset="ppo_max", advantage_estimator="grpo", num_samples_per_prompt=4, kl_placement="loss", kl_estimator="k3"
    ),
    "ppo_max_kl_loss_k2": dict(preset="ppo_max", kl_placement="loss", kl_estimator="k2"),
    "ppo_max_clip_higher": dict(preset="ppo_max", cliprange_high=0.28),
}


def ppo_config(output_dir: str, method: str = "ppo_max", iterations: int = 100, seed: int = 0, **overrides):
    """PPOMaxConfig for ``method`` in the toy world: rollouts of 32 prompts, responses of up to 24 words."""
    from trl_ppomax.ppo.config import PPOMaxConfig

    if method not in METHODS:
        raise ValueError(f"Unknown method {method!r}; choose one of {sorted(METHODS)}.")
    settings = dict(
        output_dir=output_dir,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        num_mini_batches=2,
        num_ppo_epochs=4,
        total_episodes=32 * iterations,
        response_length=24,
        stop_token="eos",
        learning_rate=3e-4,
        local_rollout_forward_batch_size=32,
        gradient_checkpointing=False,
        num_sample_generations=0,
        seed=seed,
        eval_do_sample=True,
        **SAMPLING,
        **{**QUIET, "logging_steps": 1},
    )
    return PPOMaxConfig(**{**settings, **METHODS[method], **overrides})


def ppo_trainer(world: World, config, callbacks=None, extra_rewards=()):
    """PPOMaxTrainer on the world's SFT policy and reward model (also the critic's start), logging the gold reward;
    ``extra_rewards`` are further sources after the reward model (weighted by ``config.reward_weights``)."""
    from transformers import AutoModelForSequenceClassification

    from trl_ppomax.ppo.trainer import PPOMaxTrainer

    tokenizer = PreTrainedTokenizerFast.from_pretrained(world.sft)
    ptx = None
    if config.ptx_coef > 0:
        rows = WorldSampler(seed=config.seed).sft_rows(512)
        ptx = Dataset.from_dict({"text": [r["prompt"] + r["completion"] for r in rows]})
    policy = AutoModelForCausalLM.from_pretrained(world.sft)
    reward_model = AutoModelForSequenceClassification.from_pretrained(world.reward)
    return PPOMaxTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=[reward_model, *extra_rewards] if extra_rewards else reward_model,
        train_dataset=train_prompts(seed=config.seed),
        value_model=None,
        eval_dataset=eval_prompts(),
        callbacks=callbacks,
        ptx_dataset=ptx,
        rollout_metrics=GOLD_METRICS,
    )


#: The logged metric of each training curve; the first five, evaluated, are the summary table's columns.
CURVE_KEYS = {
    "gold_reward": M.GOLD_REWARD,
    "proxy_reward": M.SCORES,
    "kl": M.KL,
    "perplexity": M.POLICY_PERPLEXITY,
    "response_length": M.RESPONSE_LENGTH,
    "policy_loss": M.POLICY_LOSS,
    "value_loss": M.VALUE_LOSS,
}
SUMMARY_KEYS = {name: M.eval_name(key) for name, key in list(CURVE_KEYS.items())[:5]}


def summarise(metrics: dict[str, float]) -> dict[str, float]:
    """The table's columns from ``trainer.evaluate()``'s metrics."""
    return {name: float(metrics[key]) for name, key in SUMMARY_KEYS.items()}


def run_method(
    world: World,
    method: str,
    output_dir: str,
    iterations: int = 100,
    seed: int = 0,
    callbacks=None,
    config_overrides: dict | None = None,
    extra_rewards=(),
):
    """Train ``method`` from the SFT policy, with ``config_overrides`` on top of its settings and ``extra_rewards``
    (:func:`ppo_trainer`); returns ``(trainer, sft_summary, final_summary, curves)``."""
    config = ppo_config(output_dir, method, iterations=iterations, seed=seed, **(config_overrides or {}))
    trainer = ppo_trainer(world, config, callbacks, extra_rewards=extra_rewards)
    if any(getattr(callback, "replaces_printer", False) for callback in callbacks or []):
        from transformers import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # a compact table is printed instead of the raw metric dicts
    sft = summarise(trainer.evaluate(metric_key_prefix="eval"))
    trainer.train()
    final = summarise(trainer.evaluate(metric_key_prefix="eval"))
    logs = [entry for entry in trainer.state.log_history if M.GOLD_REWARD in entry]
    logged = {name: key for name, key in CURVE_KEYS.items() if logs and all(key in entry for entry in logs)}
    curves = {name: [float(entry[key]) for entry in logs] for name, key in logged.items()}  # no critic: no value loss
    curves["episode"] = [float(entry[M.EPISODE]) for entry in logs]
    return trainer, sft, final, curves


def win_tie_lose_vs_sft(
    trainer, world: World, output_dir: str | os.PathLike, seed: int = 0, prompts: int = 64
) -> dict:
    """The trained policy against the SFT policy on held-out prompts, judged by the gold reward
    (:func:`trl_ppomax.judging.run.evaluate_policy`, sampled as in training): ``{"win", "tie", "lose", …,
    "win_rate", "win_rate_ci95"}`` over all prompts. ``output_dir`` is emptied first (it caches by name only)."""
    from trl_ppomax.judging.generation import GenerationSettings, load_prompts
    from trl_ppomax.judging.run import evaluate_policy
    from trl_ppomax.judging.scored import FunctionJudge

    shutil.rmtree(output_dir, ignore_errors=True)
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    settings = GenerationSettings(
        max_new_tokens=trainer.args.response_length, batch_size=32, seed=seed, do_sample=True, **SAMPLING
    )
    report = evaluate_policy(
        (policy, trainer.processing_class),
        world.sft,
        load_prompts(eval_prompts(prompts)),
        output_dir,
        [FunctionJudge(gold_rewards)],
        settings,
        names={"policy": trainer.args.output_dir, "baseline": "SFT"},
    )
    return report["judges"]["gold"]["categories"]["all"]
