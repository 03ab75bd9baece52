"""Tiny PPO-max run under a launcher: writes each rank's running reward moments and a weight checksum, and the
final policy. Usage: ddp_run.py OUTPUT_DIR [--cpu] [--no-ds3-gather]."""

import json
import sys
from pathlib import Path

import torch
from accelerate import PartialState

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/helpers.py
from helpers import tiny_trainer

output = Path(sys.argv[1])
on_cpu = "--cpu" in sys.argv
trainer = tiny_trainer(
    output,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    total_episodes=32,
    critic_warmup_steps=1,
    whiten_advantages=True,  # checked below: global whitening over both processes
    use_cpu=on_cpu,
    bf16=not on_cpu,
    ds3_gather_for_generation="--no-ds3-gather" not in sys.argv,
)
seen: list[tuple] = []  # (scores, advantages, mask) of every iteration on this process
make_experience = trainer.make_experience


def recording_make_experience(rollout):
    experience, metrics, problem = make_experience(rollout)
    seen.append((rollout.scores, experience.advantages, rollout.response_mask))
    return experience, metrics, problem


trainer.make_experience = recording_make_experience
trainer.train()
rank = PartialState().process_index
accelerator = trainer.accelerator
union_scores = torch.cat([accelerator.gather(scores) for scores, _, _ in seen])
whitening = []
for _, advantages, mask in seen:  # whitening statistics over the union of both processes' tokens
    width = accelerator.gather(torch.tensor([advantages.shape[1]])).max().item()
    padded = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in (advantages, mask.float())]
    all_advantages, all_mask = (accelerator.gather(t) for t in padded)
    valid = all_advantages[all_mask.bool()]
    whitening.append([valid.mean().item(), valid.var().item()])
result = {
    "world_size": trainer.args.world_size,
    "steps": trainer.state.global_step,
    "moments": trainer.ppo_state.running_reward.state_dict(),
    "union_mean": union_scores.double().mean().item(),
    "union_std": union_scores.double().std().item(),
    "union_count": len(union_scores),
    "whitening": whitening,
    "checksum": sum(
        p.double().sum().item() for p in trainer.accelerator.unwrap_model(trainer.model).policy.parameters()
    ),
}
(output / f"rank{rank}.json").write_text(json.dumps(result))
trainer.save_model(str(output / "policy"))
