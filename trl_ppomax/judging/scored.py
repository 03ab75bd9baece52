"""Judges that score each answer on its own and compare the scores (``base.margin_verdict``): a reward model (``rm``)
and a scoring function (``gold``, e.g. the toy world's known reward: any ``(prompts, completions) -> scores``)."""

from __future__ import annotations

import hashlib
import inspect
import os
from collections.abc import Callable, Iterable

import torch
from tqdm.auto import tqdm

from trl_ppomax.data import PromptCollator, tokenize_prompt
from trl_ppomax.judging.base import JsonlCache, Pair, Verdict, margin_verdict
from trl_ppomax.models import sequence_scores


class ScoreJudge:
    """Scores both answers of every pair not yet in the cache (``{"policy": s, "baseline": s}`` under the pair's
    key), then compares them with :func:`~trl_ppomax.judging.base.margin_verdict`. Subclasses define ``score``."""

    name = "score"

    def __init__(self, tie_threshold: float = 0.0, batch_size: int = 16) -> None:
        self.tie_threshold, self.batch_size = tie_threshold, batch_size

    def score(self, prompts: list, answers: list[str], finished: list[bool]) -> list[float]:
        raise NotImplementedError

    def settings(self) -> dict:
        return {"judge": self.name, "tie_threshold": self.tie_threshold}

    def judge(self, pairs: Iterable[Pair], cache: JsonlCache) -> list[Verdict]:
        pairs = list(pairs)
        missing = [p for p in pairs if p.key not in cache]
        for start in tqdm(range(0, len(missing), self.batch_size), desc=f"Judging ({self.name})", unit="batch"):
            chunk = missing[start : start + self.batch_size]
            prompts = [p.prompt for p in chunk] * 2
            answers = [p.policy for p in chunk] + [p.baseline for p in chunk]
            finished = [p.finished[0] for p in chunk] + [p.finished[1] for p in chunk]
            scores = self.score(prompts, answers, finished)
            for i, pair in enumerate(chunk):
                cache.put(pair.key, {"policy": scores[i], "baseline": scores[len(chunk) + i]})
        return [self.verdict(cache.get(p.key)) for p in pairs]

    def verdict(self, scores: dict) -> Verdict:
        return margin_verdict(scores["policy"], scores["baseline"], self.tie_threshold)


class FunctionJudge(ScoreJudge):
    """``function(prompts, completions) -> list[float]`` as a judge (TRL's reward-function convention), named
    ``gold`` by default: a known reward, such as the toy world's :func:`~trl_ppomax.toyworld.gold_rewards`."""

    def __init__(self, function: Callable, name: str = "gold", tie_threshold: float = 0.0) -> None:
        super().__init__(tie_threshold)
        self.function, self.name = function, name

    def score(self, prompts, answers, finished) -> list[float]:
        return [float(s) for s in self.function(prompts, answers)]

    def settings(self) -> dict:
        source = inspect.getsource(self.function) if inspect.isfunction(self.function) else repr(self.function)
        return {
            **super().settings(),
            "function": getattr(self.function, "__qualname__", repr(self.function)),
            "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        }


class RewardModelJudge(ScoreJudge):
    """A reward model (folder, Hub id or a loaded sequence-classification model with its tokenizer) scoring each
    answer on exactly the ids it was trained on: the prompt as the trainer encodes it
    (:func:`~trl_ppomax.data.tokenize_prompt`), the answer's tokens, and the stop token when the answer ended with it;
    read where the model reads its score (:func:`~trl_ppomax.models.sequence_scores`)."""

    name = "rm"

    def __init__(self, model, tokenizer=None, tie_threshold: float = 0.0, batch_size: int = 8) -> None:
        super().__init__(tie_threshold, batch_size)
        self.model_name = os.fspath(model) if isinstance(model, str | os.PathLike) else model.name_or_path
        if isinstance(model, str | os.PathLike):
            model, tokenizer = load_reward_model(model)
        if tokenizer is None:
            raise ValueError("RewardModelJudge(model=<a loaded model>) needs its tokenizer too.")
        self.model, self.tokenizer = model.eval(), tokenizer

    def settings(self) -> dict:
        return {**super().settings(), "reward_model": self.model_name}

    @torch.no_grad()
    def score(self, prompts, answers, finished) -> list[float]:
        rows = [{"input_ids": self.encode(p, a, f)} for p, a, f in zip(prompts, answers, finished, strict=True)]
        pad_id = self.tokenizer.pad_token_id
        collate = PromptCollator(self.tokenizer.eos_token_id if pad_id is None else pad_id, padding_side="right")
        return sequence_scores(self.model, {k: v.to(self.model.device) for k, v in collate(rows).items()}).tolist()

    def encode(self, prompt, answer: str, finished: bool) -> list[int]:
        tokenizer = self.tokenizer
        ids = tokenize_prompt(prompt, tokenizer) + tokenizer(answer, add_special_tokens=False)["input_ids"]
        return [*ids, tokenizer.eos_token_id] if finished and tokenizer.eos_token_id is not None else ids


def load_reward_model(name: str | os.PathLike):
    """``(model, tokenizer)``: ``AutoModelForSequenceClassification`` with one label (bfloat16 on a GPU)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    dtype, device = (torch.bfloat16, "cuda") if torch.cuda.is_available() else (torch.float32, "cpu")
    model = AutoModelForSequenceClassification.from_pretrained(os.fspath(name), num_labels=1, dtype=dtype)
    return model.to(device), AutoTokenizer.from_pretrained(os.fspath(name))
