"""The toy world's agent task: the user asks about a **secret topic** ("tell me about the secret topic"); the topic is a
column of the dataset the policy never sees, and an environment's ``lookup`` tool reveals it. The gold reward is the
world's (:func:`~trl_ppomax.toyworld.world.gold_reward`) on the policy's **final answer** (after its last tool result)
against the secret topic: without the tool the policy can only guess the topic (1 in 8).

The SFT policy (trl's SFTTrainer) imitates mediocre agents: a share ``p_tool`` of the demonstrations call the tool
first, then usually name the looked-up topic; the others guess one. Trajectories are rendered by :data:`CHAT_TEMPLATE`
over a word-level vocabulary, a tool call as ``<tool_call> {"name": "lookup", "arguments": {}} </tool_call>``
(Hermes style, parsed by :func:`trl_ppomax.generation.tools.parse_tool_calls`)::

    system: tools: lookup </s> user: tell me about the secret topic </s> assistant:   ← the prompt
    <tool_call> {"name": "lookup", "arguments": {}} </tool_call> </s>                   ← the policy (env_mask 1)
    tool: cat </s> assistant:                                                            ← the tool (env_mask 0)
    please the cat is nice </s>                                                          ← the policy (env_mask 1)
"""

from __future__ import annotations

import hashlib
import inspect
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from datasets import Dataset

from trl_ppomax.data.files import atomic_directory
from trl_ppomax.toyworld.build import TRAINING, build_fingerprint, default_cache_dir
from trl_ppomax.toyworld.tiny import llama_config, word_level_tokenizer
from trl_ppomax.toyworld.world import ASSISTANT, EOS, TOPICS, WorldSampler, gold_reward, prompt_text, vocabulary

__all__ = [
    "CHAT_TEMPLATE",
    "TOOL_CALL",
    "AgentSettings",
    "LookupEnvironment",
    "agent_gold_reward",
    "agent_prompts",
    "agent_tokenizer",
    "final_answer",
    "prepare_agent_policy",
    "tool_call_rate",
]

QUESTION = "tell me about the secret topic"
TOOL_CALL = '<tool_call> {"name": "lookup", "arguments": {}} </tool_call>'
TOOL_ROLE = "tool:"
#: ``role: content </s>`` per message; a tools line first; an assistant's tool calls as Hermes blocks.
CHAT_TEMPLATE = (
    "{% if tools %}system: tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}</s> {% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}assistant: "
    "{% for c in m['tool_calls'] %}<tool_call> {{ c['function'] | tojson }} </tool_call> {% endfor %}</s> "
    "{% else %}{{ m['role'] }}: {{ m['content'] }} </s> {% endif %}"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
_AGENT_WORDS = ["system:", "tools:", TOOL_ROLE, "lookup", "secret", "topic", *TOOL_CALL.split()]


def agent_tokenizer():
    """The world's word-level vocabulary plus the tool-calling words, with :data:`CHAT_TEMPLATE`."""
    tokenizer = word_level_tokenizer(list(dict.fromkeys([*vocabulary(), *_AGENT_WORDS])))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


class LookupEnvironment:
    """One trajectory's environment: ``reset(topic=…)`` takes the row's secret topic, ``lookup()`` reveals it."""

    def reset(self, topic: str, **row) -> None:
        self.topic = topic

    def lookup(self) -> str:
        """Look up the secret topic the user is asking about.

        Returns:
            The topic, one word.
        """
        return self.topic


def final_answer(completion: str) -> str:
    """The policy's last answer in a trajectory: what follows its last tool result (the last ``assistant:``), tool
    calls removed."""
    answer = completion.rsplit(ASSISTANT, 1)[-1]
    return " ".join(w for w in answer.split() if w not in _AGENT_WORDS)


def agent_gold_reward(prompts, completions, topic, **kwargs) -> list[float]:
    """The gold reward of each final answer against the row's secret ``topic`` (a reward function: TRL's keywords)."""
    return [gold_reward(prompt_text(t), final_answer(_text(c))) for c, t in zip(completions, topic, strict=True)]


def tool_call_rate(prompts, completions, **kwargs) -> list[float]:
    """1 for a trajectory whose policy called the tool, else 0 (a ``rollout_metrics`` entry)."""
    return [float("<tool_call>" in _text(c)) for c in completions]


def _text(completion) -> str:
    return completion if isinstance(completion, str) else " ".join(m["content"] for m in completion)


def agent_prompts(n: int, seed: int = 0) -> Dataset:
    """``n`` conversations asking about the secret topic, each with its ``topic`` column (hidden from the policy)."""
    rng = random.Random(seed * 7919 + 5)
    topics = [rng.choice(TOPICS) for _ in range(n)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": QUESTION}]] * n, "topic": topics})


@dataclass(frozen=True)
class AgentSettings:
    """What determines the cached SFT agent."""

    seed: int = 0
    hidden_size: int = 64
    layers: int = 2
    heads: int = 4  # vLLM's CPU attention needs a head size of at least 64: hidden_size / heads
    sft_dialogues: int = 8000
    sft_epochs: int = 16  # a 2-layer network learns to copy the tool's result only after ~4k steps
    sft_learning_rate: float = 3e-3
    p_tool: float = 0.4  # share of demonstrations that call the tool
    p_copy: float = 0.8  # after the tool, the share of answers that start by naming the looked-up topic

    def key(self) -> str:
        """The cache folder's name: a hash of these settings, the world's build fingerprint and the code that writes
        the demonstrations and trains on them."""
        code = [inspect.getsource(f) for f in (agent_tokenizer, sft_rows, train_agent_sft, WorldSampler)]
        identity = repr((asdict(self), build_fingerprint(), code, CHAT_TEMPLATE, TOOL_CALL, QUESTION))
        return "agent-" + hashlib.sha256(identity.encode()).hexdigest()[:12]


def sft_rows(settings: AgentSettings, tokenizer) -> list[dict[str, str]]:
    """Demonstrations: the prompt rendered with the tool, then a tool call and an answer, or a guessed answer."""
    from trl_ppomax.generation.tools import tool_schema

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tools=[tool_schema(LookupEnvironment.lookup)], tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    rng, sampler = random.Random(settings.seed + 31), WorldSampler(seed=settings.seed, p_topic=0.0)
    rows = []
    for _ in range(settings.sft_dialogues):
        topic = rng.choice(TOPICS)
        if rng.random() < settings.p_tool:  # the looked-up topic first (p_copy), else a mediocre answer
            answer = sampler.response(prompt_text(topic), rng)
            answer = f"the {topic} {answer}" if rng.random() < settings.p_copy else answer
            completion = f" {TOOL_CALL} {EOS} {TOOL_ROLE} {topic} {EOS} {ASSISTANT} {answer} {EOS}"
        else:
            completion = f" {WorldSampler(seed=settings.seed).response(prompt_text(rng.choice(TOPICS)), rng)} {EOS}"
        rows.append({"prompt": prompt, "completion": completion})
    return rows


def train_agent_sft(settings: AgentSettings, output: Path) -> None:
    """trl's SFTTrainer on the demonstrations (loss on the completion), from a Llama of the settings' size."""
    from transformers import LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    tokenizer = agent_tokenizer()
    torch.manual_seed(settings.seed)
    config = llama_config(tokenizer, settings.hidden_size, settings.layers, settings.heads, max_position_embeddings=96)
    trainer = SFTTrainer(
        model=LlamaForCausalLM(config),
        args=SFTConfig(
            output_dir=str(output / "run"),
            num_train_epochs=settings.sft_epochs,
            learning_rate=settings.sft_learning_rate,
            lr_scheduler_type="cosine",
            seed=settings.seed,
            **{**TRAINING, "max_length": 96},
        ),
        train_dataset=Dataset.from_list(sft_rows(settings, tokenizer)),
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model(str(output))
    tokenizer.save_pretrained(output)
    shutil.rmtree(output / "run", ignore_errors=True)


def prepare_agent_policy(settings: AgentSettings | None = None, cache_dir=None) -> str:
    """The SFT agent's folder (tokenizer beside the weights), trained once and cached."""
    settings = settings or AgentSettings()
    folder = Path(cache_dir or default_cache_dir()) / settings.key() / "sft"
    if not (folder / "config.json").is_file():
        with atomic_directory(folder) as temporary:
            train_agent_sft(settings, Path(temporary))
    return str(folder)


#: The benchmark's conditions: PPO-max with the environment's ``lookup`` tool, without it, and with the tool's tokens
#: trained on as if the policy wrote them (the masking ablated).
CONDITIONS: dict[str, dict] = {
    "tool": dict(environment=True),
    "no_tool": dict(environment=False),
    "tool_train_on_env_tokens": dict(environment=True, train_on_env_tokens=True),
    # What a TRL GRPO script runs: no critic, 4 trajectories per prompt (as many trajectories an iteration), k3 KL loss
    "tool_grpo": dict(
        environment=True, advantage_estimator="grpo", num_samples_per_prompt=4, kl_placement="loss",
        kl_estimator="k3", kl_coef=0.04,
    ),
}  # fmt: skip
#: The per-trajectory measurements logged next to the reward (and as ``eval_…``).
AGENT_METRICS = {"agent/tool_call_rate": tool_call_rate}


def agent_ppo_trainer(
    sft: str, output_dir: str, condition: str = "tool", iterations: int = 60, seed: int = 0, **overrides
):
    """PPOMaxTrainer (the ``ppo_max`` preset, the toy world's PPO settings) on the SFT agent under ``condition``: the
    reward is :func:`agent_gold_reward`, the critic starts from the SFT agent; trajectories of at most 24 policy
    tokens, 40 in all, 2 tool turns."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from trl_ppomax.ppo.trainer import PPOMaxTrainer
    from trl_ppomax.toyworld.pipeline import ppo_config

    if condition not in CONDITIONS:
        raise ValueError(f"Unknown condition {condition!r}; choose one of {sorted(CONDITIONS)}.")
    spec = dict(CONDITIONS[condition])
    environment = LookupEnvironment if spec.pop("environment") else None
    budgets = dict(max_completion_tokens=40, max_tool_turns=2)
    config = ppo_config(output_dir, "ppo_max", iterations=iterations, seed=seed, **{**budgets, **spec, **overrides})
    return PPOMaxTrainer(
        args=config,
        processing_class=AutoTokenizer.from_pretrained(sft),
        model=AutoModelForCausalLM.from_pretrained(sft),
        ref_model=None,
        reward_model=agent_gold_reward,
        train_dataset=agent_prompts(32 * 64, seed=seed),
        value_model=AutoModelForSequenceClassification.from_pretrained(sft, num_labels=1)
        if config.uses_critic
        else None,
        eval_dataset=agent_prompts(64, seed=1234),
        environment_factory=environment,
        rollout_metrics=AGENT_METRICS,
    )
