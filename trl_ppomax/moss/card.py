"""The model card ``trl-ppomax push`` writes for a MOSS-RLHF model (a folder made by ``trl-ppomax moss recover``).

A folder holding the conversion record (:data:`~trl_ppomax.moss.recovery.CONVERSION_INFO`) gets the MOSS-RLHF card:
licence ``agpl-3.0``, the published diff as ``base_model``, the release's prompt format, usage and the recovery
command. A folder trained from a MOSS-RLHF model gets the trl-ppomax card with the MOSS-RLHF prompt format and
licence; any other folder the generic :func:`trl_ppomax.reporting.hub.model_card`.
"""

from __future__ import annotations

import os

from huggingface_hub import ModelCard
from transformers.utils.chat_template_utils import render_jinja_template

from trl_ppomax.data.files import read_json
from trl_ppomax.moss.prompt import BOS_TOKEN, EOS_TOKEN, SPEAKER_TAGS, chat_template, format_dialogue
from trl_ppomax.moss.recovery import CONVERSION_INFO, RELEASES, recovery_command
from trl_ppomax.reporting.hub import (
    MODEL_KINDS,
    PAPER_LINK,
    ModelFolder,
    check_model_type,
    model_card,
    render_card,
    repo_like,
    trained_intro,
    trainer_sections,
)

__all__ = ["LICENCE_SECTION", "moss_model_card"]

_LANGUAGE_NAMES = {"en": "English", "zh": "Chinese"}
_EXAMPLE_TEXT = {"en": "Hi", "zh": "你好"}
LICENCE_SECTION = (
    "## Licence\n\n"
    "The MOSS-RLHF model weights are released under the **GNU AGPL-3.0**, so these derived weights are "
    "AGPL-3.0 as well (LLaMA's own licence terms also apply to the base weights). The MOSS-RLHF code is "
    "Apache-2.0 and its data CC BY-NC 4.0; trl-ppomax is Apache-2.0."
)


def _prompt_section(lang: str | None) -> str:
    """The release's prompt format for ``lang`` (both languages when None), with examples rendered by
    :func:`format_dialogue` and by the chat template :func:`~trl_ppomax.moss.prompt.setup_tokenizer` installs."""
    langs = [lang] if lang in SPEAKER_TAGS else list(SPEAKER_TAGS)
    lines = [
        "## Prompt format\n\nTurns alternate, each prefixed with its speaker tag and **no space**, and are joined by "
        f"the eos token `{EOS_TOKEN}`; the prompt ends with eos and the assistant's tag, and the model continues "
        f"from there (ending its answer with `{EOS_TOKEN}`). The last turn is the human's (the release assigns roles "
        "from the end, so a conversation may start with an assistant turn). The string is encoded with LLaMA's bos "
        f"`{BOS_TOKEN}` in front. When a conversation is too long, drop whole turns, oldest first, one at a time.\n",
    ]
    for code in langs:
        human, assistant = SPEAKER_TAGS[code]
        example = format_dialogue([{"role": "user", "content": _EXAMPLE_TEXT[code]}], code)
        lines.append(f"- {_LANGUAGE_NAMES[code]}: `{human}` / `{assistant}`, e.g. `{example}`")
    messages, template = [{"role": "user", "content": _EXAMPLE_TEXT[langs[0]]}], chat_template(langs[0])
    (rendered,), _ = render_jinja_template(
        [messages], chat_template=template, add_generation_prompt=True, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN
    )
    lines += [
        f"\nThe tokenizer's chat template writes the bos `{BOS_TOKEN}` itself, then this string: "
        "`tokenizer.apply_chat_template("
        f'[{{"role": "user", "content": "{messages[0]["content"]}"}}], tokenize=False, add_generation_prompt=True)` '
        f"gives `{rendered}`, whose ids (tokenised without adding special tokens, as `apply_chat_template` does) are "
        "the release's, with one bos.",
    ]
    return "\n".join(lines)


def _release_intro(model_type: str | None, lang: str | None, base_model: str | None) -> str:
    language = f"{_LANGUAGE_NAMES[lang]} " if lang in _LANGUAGE_NAMES else ""
    what = MODEL_KINDS.get(model_type or "", "model")
    source = f" [`{base_model}`](https://huggingface.co/{base_model})" if base_model else ""
    intro = (
        f"The {language}MOSS-RLHF {what} released with {PAPER_LINK}, recovered from the published weight "
        f"diff{source} against LLaMA-7B and converted to the standard `transformers` format with trl-ppomax."
    )
    if model_type == "reward":
        intro += (
            " It is a `LlamaForSequenceClassification` with `num_labels=1`: the release's `reward_head` is "
            "`score.weight`, and the reward is read at the last token of prompt + response."
        )
    return intro


def _recovery_section(conversion: dict, base_model: str | None, repo_id: str, model_type, lang) -> str:
    command = conversion.get("recovery_command") or recovery_command(
        conversion.get("source_raw") or "/path/to/llama-7b-hf",
        conversion.get("source_diff") or base_model or "/path/to/diff",
        f"./{repo_id.rstrip('/').split('/')[-1]}",
        model_type or "reward",
        lang or "en",
    )
    expected = conversion.get("expected_sum")
    check = "" if expected is None else f" The recovery checks that the float32 sum of the parameters is `{expected}`."
    return (
        "## How these weights were made\n\n"
        "The release stores `tuned − raw` for every parameter whose name contains `layers` (other tensors "
        f"whole); recovery adds the raw LLaMA-7B weights back.{check}\n\n```bash\n{command}\n```"
    )


def moss_model_card(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    model_type: str | None = None,
    lang: str | None = None,
    base_model: str | None = None,
) -> ModelCard:
    """The model card (README.md) for a model folder about to be pushed to ``repo_id``: the MOSS-RLHF card for a
    converted folder (or one whose base model is a MOSS-RLHF model), else the generic trl-ppomax card; either with
    the :func:`~.hub.trainer_sections` of the folder. ``model_type`` ("reward", "sft" or "policy"), ``lang`` ("en" or
    "zh") and ``base_model`` override what the conversion record and config.json say. Raises ValueError as
    :func:`~.hub.model_card`, or for an unknown ``lang``.
    """
    model = ModelFolder.read(folder)
    converted = (model.path / CONVERSION_INFO).is_file()
    conversion = read_json(model.path / CONVERSION_INFO) if converted else {}

    model_type = check_model_type(model_type or conversion.get("model_type") or model.model_type)
    lang = lang or conversion.get("lang")
    if lang is not None and lang not in SPEAKER_TAGS:
        raise ValueError(f"Unknown language {lang!r}: use one of {', '.join(SPEAKER_TAGS)}.")
    release = RELEASES.get((model_type, lang or "en")) if converted else None
    base_model = base_model or repo_like(conversion.get("source_diff")) or release or model.base_model
    common = dict(model_type=model_type, base_model=base_model, lang=lang, peft=model.peft)
    if not converted and "moss-rlhf" not in (base_model or "").lower():
        return model_card(model.path, repo_id, model_type=model_type, lang=lang, base_model=base_model)

    sections = [_recovery_section(conversion, base_model, repo_id, model_type, lang)] if converted else []
    return render_card(
        repo_id,
        intro=_release_intro(model_type, lang, base_model) if converted else trained_intro(model_type, base_model),
        prompt_section=_prompt_section(lang),
        sections=[*sections, *trainer_sections(model.path), LICENCE_SECTION],
        license="agpl-3.0",
        extra_tags=["moss-rlhf"],
        **common,
    )
