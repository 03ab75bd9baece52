"""The paper's released models (MOSS-RLHF): prompt format and chat template, tokenizer set-up, and recovery of the
weight diffs into standard transformers checkpoints."""

from .prompt import SPEAKER_TAGS, build_prompt, chat_template, format_dialogue, setup_tokenizer, truncate_dialogue
from .recovery import EXPECTED_SUMS, RELEASES, IntegrityError, recover

__all__ = [
    "EXPECTED_SUMS",
    "RELEASES",
    "SPEAKER_TAGS",
    "IntegrityError",
    "build_prompt",
    "chat_template",
    "format_dialogue",
    "recover",
    "setup_tokenizer",
    "truncate_dialogue",
]
