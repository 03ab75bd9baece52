"""Did RLHF help? Pairwise evaluation of a policy against a baseline (win / tie / lose by reward-model, LLM, human and
gold judges), the training-time win rate against SFT, and the alignment-tax check on multiple-choice questions.

The public names are imported on first access, so that ``trl-ppomax evaluate --help`` stays instant."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ALL": ".base",
    "JsonlCache": ".base",
    "Pair": ".base",
    "GenerationSettings": ".generation",
    "load_prompts": ".generation",
    "evaluate_policy": ".run",
    "FunctionJudge": ".scored",
    "RewardModelJudge": ".scored",
    "ScoreJudge": ".scored",
    "LLMJudge": ".llm",
    "HumanJudge": ".human",
    "export_sheet": ".human",
    "import_sheet": ".human",
    "WinRateCallback": ".callback",
    "compare_multiple_choice": ".mcq",
    "score_multiple_choice": ".mcq",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
