"""Train an agent with PPO-max: the toy world's secret-topic task on a laptop CPU.

The user asks about a secret topic; the environment's `lookup` tool reveals it; the reward is the toy world's gold
reward on the policy's final answer. The SFT agent (trl's SFTTrainer, built once and cached, ~4 min) calls the tool in
about 40 % of its answers; PPO-max learns to call it, and the tool's tokens are never trained on.

    python examples/ppo_max_agent.py                  # 80 iterations, a few minutes after the SFT agent is built
    python examples/ppo_max_agent.py --no-tool        # the same without the tool: the policy can only guess
    python examples/ppo_max_agent.py --quick          # a small SFT agent and 2 iterations: a smoke run
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout's trl_ppomax first

from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from trl_ppomax import PPOMaxConfig, PPOMaxTrainer
from trl_ppomax.toyworld.agent_task import (
    AgentSettings,
    LookupEnvironment,
    agent_gold_reward,
    agent_prompts,
    prepare_agent_policy,
    tool_call_rate,
)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-tool", action="store_true", help="train without the lookup tool")
    parser.add_argument("--quick", action="store_true", help="a small SFT agent and 2 iterations")
    parser.add_argument("--output-dir", default="ppo-max-agent")
    args = parser.parse_args(argv)
    settings = AgentSettings(hidden_size=32, sft_dialogues=600, sft_epochs=3) if args.quick else AgentSettings()
    iterations = 2 if args.quick else args.iterations

    sft = prepare_agent_policy(settings)  # a folder as SFTTrainer.save_model writes it, tokenizer beside the weights
    config = PPOMaxConfig(
        output_dir=args.output_dir,
        preset="ppo_max",
        total_episodes=32 * iterations,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        num_mini_batches=2,
        learning_rate=3e-4,
        response_length=24,  # the policy's tokens over all its turns
        max_completion_tokens=40,  # the whole trajectory, the tool's tokens included
        max_tool_turns=2,
        stop_token="eos",  # the chat template's end of turn
        seed=args.seed,
        eval_do_sample=True,
        num_sample_generations=0,
        report_to="none",
        save_strategy="no",
        logging_steps=10,
    )
    trainer = PPOMaxTrainer(
        args=config,
        processing_class=AutoTokenizer.from_pretrained(sft),
        model=AutoModelForCausalLM.from_pretrained(sft),
        ref_model=None,
        reward_model=agent_gold_reward,  # reads the final answer and the row's secret `topic` column
        value_model=AutoModelForSequenceClassification.from_pretrained(sft, num_labels=1),
        train_dataset=agent_prompts(32 * iterations, seed=args.seed),  # columns: prompt (a conversation), topic
        eval_dataset=agent_prompts(64, seed=1234),
        environment_factory=None if args.no_tool else LookupEnvironment,  # reset(topic=…), lookup()
        rollout_metrics={"agent/tool_call_rate": tool_call_rate},
    )
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    summary = {
        name: (round(before[key], 3), round(after[key], 3))
        for name, key in (("gold reward", "eval_objective/scores"), ("tool-call rate", "eval_agent/tool_call_rate"))
    }
    for name, (start, end) in summary.items():
        print(f"{name}: {start} (SFT) → {end} (PPO-max{' without the tool' if args.no_tool else ''})")
    return summary


if __name__ == "__main__":
    main()
