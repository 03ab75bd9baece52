"""The toy world's agent task (:mod:`trl_ppomax.toyworld.agent_task`): PPO-max with the ``lookup`` tool, without it, and
with the tool's tokens trained on (the masking ablated), from the same SFT agent, over seeds.

    python benchmarks/agent.py                                  # 3 conditions × seeds 0 1 2, 80 iterations (~30 min)
    python benchmarks/agent.py --small --iterations 2 --seed 0 --output /tmp/agent.json   # a smoke run

Every finished (condition, seed) run is appended at once to <output stem>.runs.jsonl and not run again when the command
is repeated (--fresh starts over). JSON (default benchmarks/results/agent.json): {"agent": SFT agent settings key,
"iterations", "sft": {condition: evaluation before training, mean over seeds}, "conditions": {condition: {"gold_reward_final",
"gold_reward_final_std", "tool_call_rate_final", "tool_token_logprob_final", …, "seeds": [...], "curves": {...}}}}.
The gold reward is the reward here (the task's reward function is the gold one), evaluated with sampling on 64
held-out prompts; ``tool_token_logprob`` is the policy's mean log-prob of the tokens the tool inserted in sampled
trajectories (with the tool, in every condition): how far the policy learned to write the environment's part.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trl_ppomax.base import metrics as M
from trl_ppomax.data.files import write_json
from trl_ppomax.generation import HFGeneration
from trl_ppomax.generation.agent import AgentRollouts
from trl_ppomax.ppo.scoring import policy_logprobs
from trl_ppomax.toyworld.agent_task import (
    AGENT_METRICS,
    CONDITIONS,
    AgentSettings,
    LookupEnvironment,
    agent_ppo_trainer,
    agent_prompts,
    prepare_agent_policy,
)

(TOOL_CALL_RATE,) = AGENT_METRICS
TOOL_TOKEN_LOGPROB = "tool_token_logprob"
#: The summary's fields: an evaluated metric each.
FIELDS = {
    "gold_reward": M.eval_name(M.SCORES),
    "tool_call_rate": M.eval_name(TOOL_CALL_RATE),
    "tool_token_logprob": TOOL_TOKEN_LOGPROB,
    "kl": M.eval_name(M.KL),
    "response_length": M.eval_name(M.RESPONSE_LENGTH),
}
#: The training curves kept per run (logged every iteration).
CURVES = {"gold_reward": M.SCORES, "tool_call_rate": TOOL_CALL_RATE, "tool_failure_rate": M.TOOL_FAILURE_RATE}


@torch.no_grad()
def tool_token_logprob(trainer, rows: int = 64) -> float:
    """The policy's mean log-prob of the tokens the tool inserted, in sampled trajectories on held-out prompts (with
    the environment's ``lookup``, whatever the condition): how far the policy has learned to write the tool's part."""
    dataset = agent_prompts(rows, seed=99)
    agent = AgentRollouts(trainer.args, trainer.processing_class, [], LookupEnvironment, trainer.end_token_id)
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    engine = HFGeneration(policy, trainer.args, trainer.stop_token_id, trainer.processing_class.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        columns, pad_id = {"topic": dataset["topic"]}, trainer.processing_class.pad_token_id
        out = agent.generate(engine, dataset["prompt"], columns, True, 1, pad_id, "cpu")
    logprobs = policy_logprobs(
        policy, out.query_ids, out.query_mask, out.response_ids, out.response_mask, trainer.args
    )
    inserted = out.response_mask.bool() & (out.env_mask == 0)
    return float(logprobs[inserted].mean()) if inserted.any() else float("nan")


def run(sft: str, condition: str, seed: int, iterations: int) -> dict:
    """One run: the evaluation before and after training, and the training curves."""
    start = time.time()
    with tempfile.TemporaryDirectory() as output:
        trainer = agent_ppo_trainer(sft, output, condition, iterations=iterations, seed=seed)
        before = trainer.evaluate()
        before[TOOL_TOKEN_LOGPROB] = tool_token_logprob(trainer)
        trainer.train()
        after = trainer.evaluate()
        after[TOOL_TOKEN_LOGPROB] = tool_token_logprob(trainer)
    logs = [entry for entry in trainer.state.log_history if M.SCORES in entry]
    curves = {name: [float(entry.get(key, float("nan"))) for entry in logs] for name, key in CURVES.items()}
    summary = {name: {"sft": before[key], "final": after[key]} for name, key in FIELDS.items()}
    return {"condition": condition, "seed": seed, "iterations": iterations, "summary": summary, "curves": curves,
            "seconds": time.time() - start}  # fmt: skip


def summarise(records: list[dict]) -> dict:
    """Means (and the gold reward's spread) over seeds of each field after training."""
    out = {}
    for name in FIELDS:
        finals = [r["summary"][name]["final"] for r in records]
        out[f"{name}_final"] = statistics.fmean(finals)
        if name in ("gold_reward", "tool_call_rate", "tool_token_logprob"):
            out[f"{name}_final_std"] = statistics.stdev(finals) if len(finals) > 1 else 0.0
            out[f"{name}_seeds"] = finals
    length = min(len(r["curves"]["gold_reward"]) for r in records)
    out["curves"] = {k: [statistics.fmean(r["curves"][k][i] for r in records) for i in range(length)] for k in CURVES}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conditions", nargs="+", choices=list(CONDITIONS), default=list(CONDITIONS))
    parser.add_argument("--seed", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=80)
    parser.add_argument("--output", default="benchmarks/results/agent.json")
    parser.add_argument("--fresh", action="store_true", help="forget the finished runs and start over")
    parser.add_argument("--cache-dir", help="where the SFT agent is cached")
    parser.add_argument("--small", action="store_true", help="a small SFT agent (seconds to build): a smoke run")
    args = parser.parse_args(argv)
    settings = AgentSettings(hidden_size=32, sft_dialogues=600, sft_epochs=3) if args.small else AgentSettings()
    sft = prepare_agent_policy(settings, args.cache_dir)
    output = Path(args.output)
    sidecar = output.with_suffix(".runs.jsonl")
    if args.fresh:
        sidecar.unlink(missing_ok=True)
    done = {}
    if sidecar.is_file():
        for line in sidecar.read_text().splitlines():
            record = json.loads(line)
            done[(record["agent"], record["condition"], record["seed"], record["iterations"])] = record
    for condition in args.conditions:
        for seed in args.seed:
            key = (settings.key(), condition, seed, args.iterations)
            if key in done:
                continue
            record = {"agent": settings.key(), **run(sft, condition, seed, args.iterations)}
            done[key] = record
            sidecar.parent.mkdir(parents=True, exist_ok=True)
            with sidecar.open("a") as file:
                file.write(json.dumps(record) + "\n")
            print(f"{condition} seed {seed}: {record['summary']}", flush=True)
    chosen = {c: [done[(settings.key(), c, s, args.iterations)] for s in args.seed] for c in args.conditions}
    results = {
        "agent": settings.key(),
        "iterations": args.iterations,
        "sft": {
            c: {n: statistics.fmean(r["summary"][n]["sft"] for r in runs) for n in FIELDS}
            for c, runs in chosen.items()
        },
        "conditions": {c: {**summarise(runs), "seeds": args.seed} for c, runs in chosen.items()},
    }
    write_json(output, results)
    return results


if __name__ == "__main__":
    main()
