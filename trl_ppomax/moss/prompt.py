"""The prompt format of MOSS-RLHF, the release of "Secrets of RLHF in Large Language Models Part I: PPO".

Every turn is its speaker tag glued to the text (no space) and closed by the eos token; a prompt then opens the
assistant's turn with its bare tag, and the policy's reply ends with eos::

    tag(turn_1) + text_1 + eos + tag(turn_2) + text_2 + eos + ... + tag(turn_n) + text_n + eos [+ assistant tag]

    English:  Human:Hi</s>Assistant:Hello</s>Human:How?</s>Assistant:
    Chinese:  <|Human|>你好</s><|MOSS|>你好</s><|Human|>在吗？</s><|MOSS|>

Roles are assigned **from the end**, as in the release: the last turn is the human's, so a dialogue with an even
number of turns starts with an assistant turn. Turns must alternate.

Whitespace next to a special token is dropped (a turn's trailing whitespace and, in Chinese, its leading whitespace):
the release's tokenizer (the slow SentencePiece ``LlamaTokenizer`` of transformers 4.30) stripped it. That tokenizer
also encoded each piece of text between special tokens as a new text, with SentencePiece's ``▁`` prefix
(``</s>Assistant:`` is ``</s> ▁Assistant :``); a current LLaMA tokenizer does so only when loaded with ``legacy=True``,
which :func:`setup_tokenizer` checks (:func:`check_release_tokenization`).

The tokenizer is LLaMA's (bos ``<s>``, eos ``</s>``, pad = ``<unk>`` id 0), plus the special tokens ``<|Human|>`` and
``<|MOSS|>`` for the Chinese model. The release encodes the prompt with LLaMA's bos in front
(``tokenizer(prompt).input_ids`` = ``[1, ...]``); :func:`chat_template` writes that bos itself, so its ids (tokenised
without special tokens, as the trainer does) are exactly the release's. :func:`format_dialogue` and
:func:`build_prompt` return the string without bos.

Too long a dialogue loses whole turns, oldest first, one at a time (:func:`truncate_dialogue`, the release's rule);
text inside a turn is never cut. Usage: ``docs/moss.md``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPEAKER_TAGS",
    "ZH_SPECIAL_TOKENS",
    "build_prompt",
    "chat_template",
    "check_release_tokenization",
    "format_dialogue",
    "setup_tokenizer",
    "truncate_dialogue",
]

logger = logging.getLogger(__name__)

#: ``{lang: (human tag, assistant tag)}``; each tag is glued to the turn's text with no space.
SPEAKER_TAGS = {"en": ("Human:", "Assistant:"), "zh": ("<|Human|>", "<|MOSS|>")}
#: The two special tokens the Chinese model adds to LLaMA's vocabulary, in the release's order.
ZH_SPECIAL_TOKENS = SPEAKER_TAGS["zh"]
#: LLaMA's special tokens as the release sets them: bos, eos, and ``<unk>`` (id 0) doubling as padding.
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<unk>"

_ROLES = ("user", "assistant")
_SYSTEM_ERROR = "MOSS-RLHF prompts have no system turn: drop it or fold its text into the first user message."
_EMPTY_ERROR = "messages is empty: a MOSS-RLHF prompt needs at least one user message."
_ORDER_ERROR = "messages must alternate user/assistant (the first may be either)"
_LAST_ERROR = "The last message is an assistant turn: end with a user message, or pass add_generation_prompt=False."


def _tags(lang: str) -> tuple[str, str]:
    if lang not in SPEAKER_TAGS:
        raise ValueError(f"Unknown language {lang!r}: use one of {', '.join(map(repr, SPEAKER_TAGS))}.")
    return SPEAKER_TAGS[lang]


def _validate(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> None:
    if isinstance(messages, (str, Mapping)):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts, not a single str or dict.")
    if len(messages) == 0:
        raise ValueError(_EMPTY_ERROR)
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise TypeError(f"Message {i} must be a dict with 'role' and 'content' keys, got {message!r}.")
        role, content = message["role"], message["content"]
        if role == "system":
            raise ValueError(_SYSTEM_ERROR)
        if role not in _ROLES:
            raise ValueError(f"Message {i} has role {role!r}: the MOSS-RLHF format only knows 'user' and 'assistant'.")
        if i and role == messages[i - 1]["role"]:
            raise ValueError(f"{_ORDER_ERROR}: message {i} has role {role!r}, as message {i - 1} does.")
        if not isinstance(content, str):
            raise TypeError(f"Message {i} content must be a str, got {type(content).__name__}.")
    if add_generation_prompt and messages[-1]["role"] == "assistant":
        raise ValueError(_LAST_ERROR)


def format_dialogue(
    messages: Sequence[Mapping[str, Any]],
    lang: str = "en",
    eos_token: str = EOS_TOKEN,
    add_generation_prompt: bool = True,
) -> str:
    """The MOSS-RLHF text of a dialogue: ``tag + content + eos`` per turn, then the assistant tag.

    ``messages`` are ``{"role": "user" | "assistant", "content": str}`` dicts whose roles alternate; the first may be
    an assistant turn. With ``add_generation_prompt`` (a prompt for the policy) the last message must be a user turn
    and the assistant tag is appended; without it (training text) the dialogue ends with eos::

        [user "Hi", assistant "Hello", user "How?"]  →  "Human:Hi</s>Assistant:Hello</s>Human:How?</s>Assistant:"
        [user "Hi", assistant "Hello"], add_generation_prompt=False  →  "Human:Hi</s>Assistant:Hello</s>"

    No space follows the tag; each turn's trailing whitespace (and for ``lang="zh"`` its leading whitespace) is
    dropped, as the release's tokenizer dropped it.

    Raises:
        ValueError: empty ``messages``, a "system" or unknown role, two turns in a row with the same role, an
            assistant last turn with ``add_generation_prompt``, unknown ``lang`` or no ``eos_token``.
        TypeError: a message is not a dict with "role" and "content", or a content is not a str.
    """
    tags = dict(zip(_ROLES, _tags(lang), strict=True))  # {"user": human tag, "assistant": assistant tag}
    if not eos_token:
        raise ValueError("eos_token is empty: the MOSS-RLHF format closes every turn with the eos token ('</s>').")
    _validate(messages, add_generation_prompt)
    trim = str.strip if lang == "zh" else str.rstrip  # the whitespace the release's tokenizer dropped
    text = "".join(tags[m["role"]] + trim(m["content"]) + eos_token for m in messages)
    return text + tags["assistant"] if add_generation_prompt else text


def chat_template(lang: str = "en") -> str:
    """A Jinja chat template: the tokenizer's ``bos_token`` (if any), then :func:`format_dialogue`'s text.

    The bos is written because chat templates are tokenised without special tokens: the ids are then exactly the
    release's ``tokenizer(format_dialogue(...)).input_ids``. The template raises ``jinja2.TemplateError`` on the
    inputs :func:`format_dialogue` rejects.
    """
    human, assistant = (json.dumps(tag) for tag in _tags(lang))
    content = "message['content'].strip()" if lang == "zh" else "message['content'].rstrip()"  # as format_dialogue
    system_error, empty_error, last_error = (json.dumps(e) for e in (_SYSTEM_ERROR, _EMPTY_ERROR, _LAST_ERROR))
    order_error = json.dumps(_ORDER_ERROR + ": message ")
    return (
        "{%- if not eos_token -%}{{ raise_exception('The tokenizer has no eos_token.') }}{%- endif -%}"
        "{%- if bos_token -%}{{- bos_token -}}{%- endif -%}"
        f"{{%- if messages | length == 0 -%}}{{{{ raise_exception({empty_error}) }}}}{{%- endif -%}}"
        "{%- for message in messages -%}"
        f"{{%- if message['role'] == 'system' -%}}{{{{ raise_exception({system_error}) }}}}"
        "{%- elif message['role'] not in ['user', 'assistant'] -%}"
        "{{ raise_exception('Unknown role ' ~ message['role'] ~ \": use 'user' or 'assistant'.\") }}"
        "{%- elif not loop.first and message['role'] == loop.previtem['role'] -%}"
        f"{{{{ raise_exception({order_error} ~ loop.index0 ~ ' has role ' ~ message['role'] ~ "
        "', as the one before.') }}"
        "{%- elif message['content'] is not string -%}"
        "{{ raise_exception('Message contents must be strings.') }}"
        "{%- endif -%}"
        "{%- if message['role'] == 'user' -%}"
        f"{{{{- {human} + {content} + eos_token -}}}}"
        # the assistant's turn, tag and eos included: what the release's ptx loss counts
        "{%- else -%}{%- generation -%}"
        f"{{{{- {assistant} + {content} + eos_token -}}}}"
        "{%- endgeneration -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}"
        f"{{%- if messages[-1]['role'] == 'assistant' -%}}{{{{ raise_exception({last_error}) }}}}{{%- endif -%}}"
        f"{{{{- {assistant} -}}}}"
        "{%- endif -%}"
    )


def setup_tokenizer(tokenizer: Any, lang: str = "en") -> Any:
    """Make a LLaMA tokenizer behave as in the release; returns the same tokenizer (changed in place). Idempotent.

    - pad token = ``<unk>`` (id 0 in LLaMA; a warning if it is another id) and left padding;
    - ``lang="zh"``: adds ``<|Human|>`` and ``<|MOSS|>`` as extra special tokens, in that order, unless already
      special (ids 32000 and 32001 on a bare LLaMA vocabulary: the embedding matrix needs ``len(tokenizer)`` rows);
    - the chat template is :func:`chat_template` for ``lang``; a warning if the eos token is not ``</s>``;
    - :func:`check_release_tokenization` must pass; ``legacy=True`` is written to the saved config, to reload the same.

    Raises:
        ValueError: no ``<unk>`` token, unknown ``lang``, or text after a special token encoded unlike the release
            (load the tokenizer with ``legacy=True``).
    """
    _tags(lang)
    if PAD_TOKEN not in tokenizer.get_vocab():
        raise ValueError(
            f"The tokenizer's vocabulary has no {PAD_TOKEN!r} token, which MOSS-RLHF uses for padding (LLaMA's id 0): "
            "use the LLaMA tokenizer the models were trained with."
        )
    if tokenizer.pad_token != PAD_TOKEN:
        tokenizer.pad_token = PAD_TOKEN
    if tokenizer.pad_token_id != 0:
        logger.warning("The pad token %r has id %s, not 0 as in LLaMA.", PAD_TOKEN, tokenizer.pad_token_id)
    tokenizer.padding_side = "left"
    # what save_pretrained writes, so that a reload pads (and encodes, below) the same
    init_kwargs = tokenizer.init_kwargs if isinstance(getattr(tokenizer, "init_kwargs", None), dict) else {}
    init_kwargs["padding_side"] = "left"
    if tokenizer.eos_token != EOS_TOKEN:
        eos = tokenizer.eos_token
        logger.warning(
            "The tokenizer's eos token is %r, not %r as in MOSS-RLHF: turns will close with it.", eos, EOS_TOKEN
        )
    if lang == "zh" and (missing := [t for t in ZH_SPECIAL_TOKENS if t not in tokenizer.all_special_tokens]):
        tokenizer.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
    tokenizer.chat_template = chat_template(lang)
    check_release_tokenization(tokenizer, lang)
    if getattr(tokenizer, "legacy", None) is True:
        init_kwargs["legacy"] = True
    return tokenizer


def check_release_tokenization(tokenizer: Any, lang: str = "en") -> None:
    """Raise ValueError unless ``tokenizer`` encodes the text after a special token as the release's did: as a new
    text, with SentencePiece's ``▁`` prefix, so ``ids(special + text) == ids(special) + ids(text)``.

    Checked: ``</s>`` and each English tag (``</s>Assistant:`` → ``</s> ▁Assistant :``), or each Chinese tag and a
    content (``<|Human|>Hi`` → ``<|Human|> ▁Hi``); a special token the tokenizer treats as ordinary text is skipped.
    A LLaMA tokenizer loaded with ``legacy=False`` (current transformers' default) drops the ``▁``.
    """
    # (special token, the text after it); after a Chinese tag, any text shows the ``▁`` prefix
    pairs = [(tag, "Hi") if lang == "zh" else (tokenizer.eos_token, tag) for tag in _tags(lang)]
    added = set(tokenizer.get_added_vocab())

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    for special, text in pairs:
        if special not in added:
            continue
        together, apart = ids(special + text), ids(special) + ids(text)
        if together != apart:
            tokens = tokenizer.convert_ids_to_tokens
            raise ValueError(
                f"The tokenizer encodes {special + text!r} as {tokens(together)}, but the MOSS-RLHF release (a slow "
                f"SentencePiece LlamaTokenizer) encoded the text after {special!r} as a new text, {tokens(apart)}. "
                "Load the tokenizer with legacy=True (AutoTokenizer.from_pretrained(path, legacy=True))."
            )


def _eos(tokenizer: Any) -> str:
    if not tokenizer.eos_token:
        raise ValueError("The tokenizer has no eos token: the MOSS-RLHF format closes every turn with it ('</s>').")
    return tokenizer.eos_token


def truncate_dialogue(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    max_tokens: int,
    lang: str = "en",
    *,
    add_special_tokens: bool = True,
) -> list[Mapping[str, Any]] | None:
    """The most recent turns of a dialogue whose prompt fits in ``max_tokens`` tokens, or None if none does.

    The release's rule (``ppo_datahelper.py``, via :func:`trl_ppomax.data.drop_oldest_turns`): whole turns are
    dropped from the start, **one at a time** (what is kept may start with an assistant turn), until
    ``len(tokenizer(format_dialogue(kept, lang, eos), add_special_tokens=add_special_tokens).input_ids)`` fits
    (by default counted with LLaMA's bos, as the release encodes it). ``messages`` must end with a user turn.

    Returns ``messages[k:]`` for the smallest ``k`` that fits (the same dicts, in a new list), or **None** when even
    the last user turn alone is too long: keep it whole or skip it (as :func:`trl_ppomax.data.prepare_prompt_dataset`).
    Raises ValueError when ``max_tokens`` is not a positive int, the messages are not a valid prompt
    (:func:`format_dialogue`), or the tokenizer has no eos token.
    """
    from trl_ppomax.data import drop_oldest_turns

    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}.")
    messages = list(messages)
    format_dialogue(messages, lang, _eos(tokenizer))  # validates: alternating, ends with a user turn
    kept = drop_oldest_turns(messages, lambda kept: _n_tokens(tokenizer, kept, lang, add_special_tokens) <= max_tokens)
    if kept is not None and (dropped := len(messages) - len(kept)):
        logger.debug("Dropped the %d oldest turns to fit the prompt in %d tokens.", dropped, max_tokens)
    return kept


def _n_tokens(tokenizer: Any, messages: list[Mapping[str, Any]], lang: str, add_special_tokens: bool = True) -> int:
    prompt = format_dialogue(messages, lang, _eos(tokenizer))
    return len(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])


def build_prompt(
    messages: Sequence[Mapping[str, Any]], tokenizer: Any, max_tokens: int | None = None, lang: str = "en"
) -> str:
    """The policy's prompt: ``format_dialogue(truncate_dialogue(messages, ...), lang, tokenizer.eos_token)``; with
    ``max_tokens=None`` nothing is dropped. ``tokenizer(prompt)`` gives the release's ids (bos first). Raises
    ValueError as :func:`truncate_dialogue`, and when even the last user turn alone is longer than ``max_tokens``.
    """
    if max_tokens is not None:
        kept = truncate_dialogue(messages, tokenizer, max_tokens, lang)
        if kept is None:
            length = _n_tokens(tokenizer, [messages[-1]], lang)
            raise ValueError(
                f"The last user turn alone takes {length} tokens (with bos, tags and eos), more than the prompt "
                f"budget max_tokens={max_tokens}: shorten it, raise max_tokens, or skip this sample."
            )
        messages = kept
    return format_dialogue(messages, lang, _eos(tokenizer), add_generation_prompt=True)
