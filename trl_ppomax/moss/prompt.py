"""The prompt format of MOSS-RLHF, the release of "Secrets of RLHF in Large Language Models Part I: PPO".

Every turn is its speaker tag glued to the text (no space) and closed by the eos token; a prompt then opens the
assistant's turn with its bare tag, and the policy's reply ends with eos::

    tag(turn_1) + text_1 + eos + tag(turn_2) + text_2 + eos + ... + tag(turn_n) + text_n + eos [+ assistant tag]

    English:  Human:Hi</s>Assistant:Hello</s>Human:How?</s>Assistant:
    Chinese:  <|Human|>你好</s><|MOSS|>你好</s><|Human|>在吗？</s><|MOSS|>

The tags are :data:`SPEAKER_TAGS`; the tokenizer is LLaMA's (bos ``<s>``, eos ``</s>``, pad = ``<unk>`` id 0), plus
the special tokens ``<|Human|>`` and ``<|MOSS|>`` for the Chinese model. The release encodes the prompt string with
the tokenizer's special tokens, i.e. with LLaMA's bos in front: ``tokenizer(prompt).input_ids`` =
``[1, ...]``. :func:`chat_template` renders the same string but, like every chat template, is tokenised by
``apply_chat_template(..., tokenize=True)`` *without* special tokens, so no bos: to get the release's ids, render
with ``tokenize=False`` (or use :func:`build_prompt`) and call the tokenizer on the string.

Example::

    >>> from trl_ppomax.moss.prompt import build_prompt, format_dialogue, setup_tokenizer
    >>> format_dialogue([{"role": "user", "content": "Hi"}])
    'Human:Hi</s>Assistant:'
    >>> tokenizer = setup_tokenizer(AutoTokenizer.from_pretrained(llama_path), lang="en")  # doctest: +SKIP
    >>> prompt = build_prompt(messages, tokenizer, max_tokens=512)  # doctest: +SKIP
    >>> input_ids = tokenizer(prompt).input_ids  # bos + prompt, as the release  # doctest: +SKIP
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
_SYSTEM_ERROR = (
    "MOSS-RLHF prompts have no system turn (the release's format is only alternating Human/Assistant turns): "
    "drop the system message or fold its text into the first user message."
)
_EMPTY_ERROR = "messages is empty: a MOSS-RLHF prompt needs at least one user message."
_ORDER_ERROR = "messages must alternate user/assistant, starting with a user message"
_LAST_ERROR = (
    "The last message is an assistant turn, so add_generation_prompt=True would open a second assistant turn in a "
    "row: end with a user message, or pass add_generation_prompt=False (a finished dialogue, as in training data)."
)


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
        expected = _ROLES[i % 2]
        if role != expected:
            raise ValueError(f"{_ORDER_ERROR}: message {i} has role {role!r} where {expected!r} is expected.")
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

    ``messages`` are OpenAI-style ``{"role": "user" | "assistant", "content": str}`` dicts alternating user,
    assistant, user, ... With ``add_generation_prompt`` (a prompt for the policy) the last message must be a user
    turn and the assistant tag is appended; without it (training text) the dialogue simply ends with eos::

        [user "Hi", assistant "Hello", user "How?"]  →  "Human:Hi</s>Assistant:Hello</s>Human:How?</s>Assistant:"
        [user "Hi", assistant "Hello"], add_generation_prompt=False  →  "Human:Hi</s>Assistant:Hello</s>"

    Contents are used verbatim (no stripping, no space after the tag).

    Raises:
        ValueError: empty ``messages``, a "system" or unknown role, turns that do not alternate starting with
            "user", an assistant last turn with ``add_generation_prompt``, unknown ``lang`` or no ``eos_token``.
        TypeError: a message is not a dict with "role" and "content", or a content is not a str.
    """
    human, assistant = _tags(lang)
    if not eos_token:
        raise ValueError("eos_token is empty: the MOSS-RLHF format closes every turn with the eos token ('</s>').")
    _validate(messages, add_generation_prompt)
    tags = {"user": human, "assistant": assistant}
    text = "".join(tags[m["role"]] + m["content"] + eos_token for m in messages)
    return text + assistant if add_generation_prompt else text


def chat_template(lang: str = "en") -> str:
    """A Jinja chat template rendering exactly :func:`format_dialogue` with the tokenizer's ``eos_token``.

    ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` ==
    ``format_dialogue(messages, lang, tokenizer.eos_token)``; with ``add_generation_prompt=False`` (the default of
    ``apply_chat_template``) the last turn just ends with eos. No bos is written: the release gets it from the
    tokenizer (``tokenizer(text)``), whereas ``apply_chat_template(..., tokenize=True)`` adds none. The template
    raises (``jinja2.TemplateError``) on the same inputs :func:`format_dialogue` rejects.
    """
    human, assistant = (json.dumps(tag) for tag in _tags(lang))
    system_error, empty_error, last_error = (json.dumps(e) for e in (_SYSTEM_ERROR, _EMPTY_ERROR, _LAST_ERROR))
    order_error = json.dumps(_ORDER_ERROR + ": message ")
    return (
        "{%- if not eos_token -%}{{ raise_exception('The tokenizer has no eos_token.') }}{%- endif -%}"
        f"{{%- if messages | length == 0 -%}}{{{{ raise_exception({empty_error}) }}}}{{%- endif -%}}"
        "{%- for message in messages -%}"
        f"{{%- if message['role'] == 'system' -%}}{{{{ raise_exception({system_error}) }}}}"
        "{%- elif message['role'] not in ['user', 'assistant'] -%}"
        "{{ raise_exception('Unknown role ' ~ message['role'] ~ \": use 'user' or 'assistant'.\") }}"
        "{%- elif (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
        f"{{{{ raise_exception({order_error} ~ loop.index0 ~ ' has role ' ~ message['role'] ~ '.') }}}}"
        "{%- elif message['content'] is not string -%}"
        "{{ raise_exception('Message contents must be strings.') }}"
        "{%- endif -%}"
        f"{{{{- ({human} if message['role'] == 'user' else {assistant}) + message['content'] + eos_token -}}}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}"
        f"{{%- if messages[-1]['role'] == 'assistant' -%}}{{{{ raise_exception({last_error}) }}}}{{%- endif -%}}"
        f"{{{{- {assistant} -}}}}"
        "{%- endif -%}"
    )


def setup_tokenizer(tokenizer: Any, lang: str = "en") -> Any:
    """Make a LLaMA tokenizer behave as in the release; returns the same tokenizer (changed in place). Idempotent.

    - pad token = ``<unk>`` (id 0 in LLaMA; a warning if it is another id) and left padding;
    - ``lang="zh"``: adds ``<|Human|>`` and ``<|MOSS|>`` as extra special tokens (never split, skipped by
      ``decode(..., skip_special_tokens=True)``), in that order, unless already special. On a bare LLaMA vocabulary
      they get ids 32000 and 32001: the model's embedding matrix must have ``len(tokenizer)`` rows;
    - the chat template is :func:`chat_template` for ``lang``;
    - a warning if the eos token is not ``</s>`` (the format closes turns with the tokenizer's eos).

    Raises:
        ValueError: the vocabulary has no ``<unk>`` token, or ``lang`` is unknown.
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
    if isinstance(getattr(tokenizer, "init_kwargs", None), dict):
        tokenizer.init_kwargs["padding_side"] = "left"  # so that save_pretrained writes it too
    if tokenizer.eos_token != EOS_TOKEN:
        logger.warning(
            "The tokenizer's eos token is %r, not %r as in the MOSS-RLHF (LLaMA) tokenizer: prompts will close turns "
            "with %r.",
            tokenizer.eos_token,
            EOS_TOKEN,
            tokenizer.eos_token,
        )
    if lang == "zh":
        missing = [t for t in ZH_SPECIAL_TOKENS if t not in tokenizer.all_special_tokens]
        if missing:
            tokenizer.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
    tokenizer.chat_template = chat_template(lang)
    return tokenizer


def _eos(tokenizer: Any) -> str:
    if not tokenizer.eos_token:
        raise ValueError("The tokenizer has no eos token: the MOSS-RLHF format closes every turn with it ('</s>').")
    return tokenizer.eos_token


def _cut_points(tokenizer: Any, text: str) -> list[int]:
    """Ascending character positions where ``text`` may be cut: token starts if offsets are available, else all."""
    if getattr(tokenizer, "is_fast", False):
        try:
            offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        except (NotImplementedError, ValueError, KeyError, TypeError):
            offsets = None
        if offsets:
            return sorted({0, len(text), *(start for start, end in offsets if end > start)})
    return list(range(len(text) + 1))


def truncate_dialogue(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    max_tokens: int,
    lang: str = "en",
    *,
    add_special_tokens: bool = True,
) -> list[Mapping[str, Any]]:
    """The most recent part of a dialogue whose prompt fits in ``max_tokens`` tokens.

    The prompt is ``format_dialogue(kept, lang, tokenizer.eos_token)`` (with the generation prompt) and its length
    is ``len(tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)``, i.e. by default counted with
    LLaMA's bos, as the release encodes it. ``messages`` must end with a user turn.

    1. Whole exchanges are dropped from the start, oldest first, until it fits: ``messages[2k:]`` for the smallest
       ``k``; what is kept still starts with a user turn and ends with the final user turn.
    2. If even the final user turn alone is too long, only it is kept and its content is cut **from the left**
       (the end of the text is kept), at a token boundary when the tokenizer gives offsets (fast tokenizers),
       otherwise at a character, with leading whitespace removed, to the longest ending that fits (a warning is
       logged). This never raises for a long turn; it raises only if ``max_tokens`` cannot hold even an empty
       turn (``tag + eos + assistant tag``, plus bos).

    Differences from the release: it drops *one* turn at a time (so a history may start with an assistant turn)
    and never cuts text (a prompt still too long is skipped with a warning).

    Returns:
        A new list; kept messages are the same dict objects, a cut one is a copy with the new ``content``.

    Raises:
        ValueError: ``max_tokens`` is not a positive int or is too small for an empty turn, the messages are not a
            valid prompt (see :func:`format_dialogue`), or the tokenizer has no eos token.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}.")
    eos = _eos(tokenizer)
    messages = list(messages)
    format_dialogue(messages, lang, eos)  # validates: alternating, ends with a user turn

    def n_tokens(kept: list[Mapping[str, Any]]) -> int:
        prompt = format_dialogue(kept, lang, eos)
        return len(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    for start in range(0, len(messages), 2):
        kept = messages[start:]
        if n_tokens(kept) <= max_tokens:
            if start:
                logger.debug("Dropped the %d oldest messages to fit the prompt in %d tokens.", start, max_tokens)
            return kept

    last = messages[-1]
    content = last["content"]

    def cut(at: int) -> list[Mapping[str, Any]]:
        return [{**last, "content": content[at:].lstrip() if at else content}]

    floor = n_tokens(cut(len(content)))
    if floor > max_tokens:
        raise ValueError(
            f"max_tokens={max_tokens} cannot hold even an empty user turn: the bare prompt takes {floor} tokens."
        )
    # Binary search for the smallest cut that fits; the last point (empty text) is known to fit.
    points = _cut_points(tokenizer, content)
    lo, hi = 0, len(points) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if n_tokens(cut(points[mid])) <= max_tokens:
            hi = mid
        else:
            lo = mid + 1
    result = cut(points[hi])
    logger.warning(
        "The last user turn alone does not fit in %d tokens: kept its last %d of %d characters.",
        max_tokens,
        len(result[0]["content"]),
        len(content),
    )
    return result


def build_prompt(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    max_tokens: int | None = None,
    lang: str = "en",
) -> str:
    """The policy's prompt: ``format_dialogue(truncate_dialogue(messages, ...), lang, tokenizer.eos_token)``.

    With ``max_tokens=None`` nothing is dropped. Tokenise the result with ``tokenizer(prompt)`` to get the
    release's ids (bos first, see the module docstring).
    """
    if max_tokens is not None:
        messages = truncate_dialogue(messages, tokenizer, max_tokens, lang)
    return format_dialogue(messages, lang, _eos(tokenizer), add_generation_prompt=True)
