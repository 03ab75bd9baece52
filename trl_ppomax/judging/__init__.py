"""Did RLHF help? Pairwise evaluation of a policy against a baseline (win / tie / lose by reward-model, LLM, human and
gold judges), the training-time win rate against SFT, and the alignment-tax check on multiple-choice questions. The
public names are imported on first access, so that ``trl-ppomax evaluate --help`` stays instant."""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {
    ".base": ("ALL", "JsonlCache", "Pair"),
    ".answers": ("GenerationSettings", "load_prompts"),
    ".run": ("evaluate_policy",),
    ".scored": ("FunctionJudge", "RewardModelJudge", "ScoreJudge"),
    ".llm": ("LLMJudge",),
    ".human": ("HumanJudge", "export_sheet", "import_sheet"),
    ".callback": ("WinRateCallback",),
    ".mcq": ("compare_multiple_choice", "score_multiple_choice"),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = globals()[name] = getattr(importlib.import_module(_LAZY[name], __name__), name)  # cached
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
