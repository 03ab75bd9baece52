"""The paper's released models (MOSS-RLHF): prompt format and chat template, tokenizer set-up, recovery of the
weight diffs into standard transformers checkpoints, and their model card. Every MOSS-RLHF fact lives here."""

from trl_ppomax.moss.card import moss_model_card
from trl_ppomax.moss.prompt import (
    SPEAKER_TAGS,
    build_prompt,
    chat_template,
    format_dialogue,
    setup_tokenizer,
    truncate_dialogue,
)
from trl_ppomax.moss.recovery import EXPECTED_SUMS, RELEASES, IntegrityError, recover

__all__ = [
    "EXPECTED_SUMS",
    "RELEASES",
    "SPEAKER_TAGS",
    "IntegrityError",
    "build_prompt",
    "chat_template",
    "format_dialogue",
    "moss_model_card",
    "recover",
    "setup_tokenizer",
    "truncate_dialogue",
]
