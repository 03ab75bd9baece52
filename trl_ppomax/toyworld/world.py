"""A small synthetic dialogue world with a known gold preference function.

A user asks about a topic ("tell me about the cat"); a response is a short sequence of words. The gold reward
prefers responses that name the prompt's topic, are polite, have a length in a sweet spot, repeat no word and stay
off other topics:

    gold = 1.0·[topic named] + 0.5·[polite word] − 0.5·#(other topics) − 0.3·#(repeated words)
           − 0.15·max(0, n − 12) − 0.15·max(0, 5 − n)          (n = number of words)

The best responses score 1.5. A reward model trained on pairs labelled by it learns the easy parts (topic words,
politeness, "more is better") but not the limits (no repetition, a length cap), so it can be exploited: repeating
rewarded words to the maximum length raises the proxy reward while the gold reward falls.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

TOPICS = ("cat", "dog", "sun", "moon", "tea", "rain", "book", "music")
POLITE = ("please", "thanks", "kindly")
FILLER = [
    "the", "a", "is", "very", "and", "it", "so", "nice", "good", "warm", "small", "big", "old", "new", "my", "your",
    "we", "like", "love", "see", "find", "make", "today", "here", "there", "always", "often", "more", "some", "all",
]  # fmt: skip
PROMPT_TEMPLATES = ("tell me about the {}", "what do you think of the {}", "describe the {}", "talk about the {}")
PROMPT_WORDS = sorted({w for t in PROMPT_TEMPLATES for w in t.replace("{}", "").split()})
SPECIALS = ("[PAD]", "[UNK]", "<s>", "</s>")
USER, ASSISTANT, EOS = "user:", "assistant:", "</s>"
SWEET_SPOT = (5, 12)


def vocabulary() -> list[str]:
    return list(dict.fromkeys([*SPECIALS, USER, ASSISTANT, *TOPICS, *POLITE, *FILLER, *PROMPT_WORDS]))


def prompt_text(topic: str, template: int = 0) -> str:
    """The prompt as the policy sees it: ``user: tell me about the cat </s> assistant:``."""
    return f"{USER} {PROMPT_TEMPLATES[template].format(topic)} {EOS} {ASSISTANT}"


def topic_of(prompt: str) -> str:
    found = [t for t in TOPICS if f" {t} " in f" {prompt} "]
    if len(found) != 1:
        raise ValueError(f"Not a toy-world prompt (expected exactly one topic word): {prompt!r}")
    return found[0]


def response_words(response: str) -> list[str]:
    """The words of a response, without special tokens."""
    return [w for w in response.split() if w not in SPECIALS and w not in (USER, ASSISTANT)]


def gold_reward(prompt: str, response: str) -> float:
    """The known preference function (see the module docstring)."""
    topic, words = topic_of(prompt), response_words(response)
    n = len(words)
    score = 1.0 * (topic in words) + 0.5 * any(w in POLITE for w in words)
    score -= 0.5 * len({w for w in words if w in TOPICS and w != topic})
    score -= 0.3 * (n - len(set(words)))
    score -= 0.15 * max(0, n - SWEET_SPOT[1]) + 0.15 * max(0, SWEET_SPOT[0] - n)
    return score


def gold_rewards(prompts: list[str], completions: list[str]) -> list[float]:
    """Batch form, ``(prompts, completions) -> scores``: usable as a reward function or a monitoring metric."""
    return [gold_reward(p, c) for p, c in zip(prompts, completions, strict=True)]


@dataclass(frozen=True)
class WorldSampler:
    """Prompts and mediocre SFT responses: the topic with probability ``p_topic``, a polite word with ``p_polite``,
    another topic with ``p_other``, the rest filler words drawn with replacement, 3–12 words."""

    seed: int = 0
    p_topic: float = 0.5
    p_polite: float = 0.3
    p_other: float = 0.2

    def prompts(self, n: int, offset: int = 0) -> list[str]:
        rng = random.Random(self.seed * 1_000_003 + offset)
        return [prompt_text(rng.choice(TOPICS), rng.randrange(len(PROMPT_TEMPLATES))) for _ in range(n)]

    def response(self, prompt: str, rng: random.Random) -> str:
        topic = topic_of(prompt)
        words = [rng.choice(FILLER) for _ in range(rng.randint(3, 12))]
        for word, p in ((topic, self.p_topic), (rng.choice(POLITE), self.p_polite)):
            if rng.random() < p:
                words[rng.randrange(len(words))] = word
        if rng.random() < self.p_other:
            words[rng.randrange(len(words))] = rng.choice([t for t in TOPICS if t != topic])
        return " ".join(words)

    def sft_rows(self, n: int) -> list[dict[str, str]]:
        rng = random.Random(self.seed + 17)
        return [{"prompt": p, "completion": f" {self.response(p, rng)} {EOS}"} for p in self.prompts(n, offset=1)]


def bradley_terry_label(gold_a: float, gold_b: float, rng: random.Random, scale: float = 2.0) -> bool:
    """Whether ``a`` is preferred: sampled with probability σ(scale · (gold_a − gold_b))."""
    return rng.random() < 1.0 / (1.0 + math.exp(-scale * (gold_a - gold_b)))
