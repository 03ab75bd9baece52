"""The prompt format of MOSS-RLHF, the release of "Secrets of RLHF in Large Language Models Part I: PPO".

Every turn is its speaker tag glued to the text (no space) and closed by the eos token; a prompt then opens the
assistant's turn with its bare tag, and the policy's reply ends with eos::

    tag(turn_1) + text_1 + eos + tag(turn_2) + text_2 + eos + ... + tag(turn_n) + text_n + eos [+ assistant tag]

    English:  Human:Hi</s>Assistant:Hello</s>Human:How?</s>Assistant:
    Chinese:  <|Human|>你好</s><|MOSS|>你好</s><|Human|>在吗？</s><|MOSS|>

Roles are assigned **from the end**, as in the release: the last turn is the human's, so a dialogue with an even
number of turns starts with an assistant turn. Turns must alternate; the first may be either speaker's.

Whitespace next to a special token is dropped: a turn's trailing whitespace (before ``</s>``) and, in Chinese, its
leading whitespace (after the special tag). The release's tokenizer (the slow SentencePiece ``LlamaTokenizer`` of
transformers 4.30, whose ``eos_token`` and tags it set as plain strings) stripped it, so the release's ids never held
it. That tokenizer also encoded each piece of text between special tokens as a new text, with SentencePiece's ``▁``
prefix: ``</s>Assistant:`` is ``</s> ▁Assistant :``. A current LLaMA tokenizer does that only when loaded with
``legacy=True``; :func:`setup_tokenizer` checks it (:func:`check_release_tokenization`).

The tags are :data:`SPEAKER_TAGS`; the tokenizer is LLaMA's (bos ``<s>``, eos ``</s>``, pad = ``<unk>`` id 0), plus
the special tokens ``<|Human|>`` and ``<|MOSS|>`` for the Chinese model. The release encodes the prompt string with
the tokenizer's special tokens, i.e. with LLaMA's bos in front: ``tokenizer(prompt).input_ids`` = ``[1, ...]``.
:func:`chat_template` writes that bos itself (``{{ bos_token }}`` + the same string), so the chat template's ids
(``apply_chat_template(..., tokenize=True)``, or its text tokenised with ``add_special_tokens=False`` as the trainer
does) are exactly the release's ids, with one bos. :func:`format_dialogue` and :func:`build_prompt` return the string
without bos: tokenise it with ``tokenizer(prompt)``.

Too long a dialogue loses whole turns, oldest first, one at a time (:func:`truncate_dialogue`, the release's rule);
text inside a turn is never cut. The trainer keeps a prompt whose last turn alone is too long whole while it and a full
response fit the policy's context, and skips it beyond (:func:`trl_ppomax.data.prepare_prompt_dataset`).

Example::

    >>> from trl_ppomax.moss.prompt import build_prompt, format_dialogue, setup_tokenizer
    >>> format_dialogue([{"role": "user", "content": "Hi"}])
    'Human:Hi</s>Assistant:'
    >>> tokenizer = setup_tokenizer(AutoTokenizer.from_pretrained(llama_path, legacy=True), "en")  # doctest: +SKIP
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
_SYSTEM_ERROR = (
    "MOSS-RLHF prompts have no system turn (the release's format is only alternating Human/Assistant turns): "
    "drop the system message or fold its text into the first user message."
)
_EMPTY_ERROR = "messages is empty: a MOSS-RLHF prompt needs at least one user message."
_ORDER_ERROR = "messages must alternate user/assistant (the first may be either)"
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

    No space follows the tag; whitespace next to a special token is dropped as the release's tokenizer dropped it
    (every turn's trailing whitespace, and for ``lang="zh"`` its leading whitespace too; see the module docstring).

    Raises:
        ValueError: empty ``messages``, a "system" or unknown role, two turns in a row with the same role, an
            assistant last turn with ``add_generation_prompt``, unknown ``lang`` or no ``eos_token``.
        TypeError: a message is not a dict with "role" and "content", or a content is not a str.
    """
    human, assistant = _tags(lang)
    if not eos_token:
        raise ValueError("eos_token is empty: the MOSS-RLHF format closes every turn with the eos token ('</s>').")
    _validate(messages, add_generation_prompt)
    tags = {"user": human, "assistant": assistant}
    text = "".join(tags[m["role"]] + _trim(m["content"], lang) + eos_token for m in messages)
    return text + assistant if add_generation_prompt else text


def _trim(content: str, lang: str) -> str:
    """``content`` without the whitespace the release's tokenizer dropped next to special tokens."""
    return content.strip() if lang == "zh" else content.rstrip()


def chat_template(lang: str = "en") -> str:
    """A Jinja chat template rendering the tokenizer's ``bos_token`` and then :func:`format_dialogue`.

    ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` ==
    ``tokenizer.bos_token + format_dialogue(messages, lang, tokenizer.eos_token)`` (no bos if the tokenizer has
    none). The bos is written because chat templates are tokenised without special tokens: the ids are then exactly
    the release's ``tokenizer(format_dialogue(...)).input_ids``. The template raises (``jinja2.TemplateError``) on
    the same inputs :func:`format_dialogue` rejects.
    """
    human, assistant = (json.dumps(tag) for tag in _tags(lang))
    content = "message['content'].strip()" if lang == "zh" else "message['content'].rstrip()"  # as _trim
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
    - text after a special token must be encoded as the release's tokenizer did (:func:`check_release_tokenization`);
      a LLaMA tokenizer's ``legacy=True`` is written to its saved config, so that it reloads the same way.

    Raises:
        ValueError: the vocabulary has no ``<unk>`` token, ``lang`` is unknown, or the tokenizer encodes text after
            a special token differently from the release (load it with ``legacy=True``).
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
    check_release_tokenization(tokenizer, lang)
    if getattr(tokenizer, "legacy", None) is True and isinstance(getattr(tokenizer, "init_kwargs", None), dict):
        tokenizer.init_kwargs["legacy"] = True  # so that save_pretrained writes it and a reload encodes the same
    return tokenizer


#: A text to put after the Chinese tags in :func:`check_release_tokenization` (any text shows the ``▁`` prefix).
_PROBE = "Hi"


def check_release_tokenization(tokenizer: Any, lang: str = "en") -> None:
    """Raise unless ``tokenizer`` encodes the text that follows a special token in the MOSS format as the release's
    did: as a new text, with SentencePiece's ``▁`` prefix, so ``ids(special + text) == ids(special) + ids(text)``.

    The special token and its text: ``</s>`` and each English tag (``</s>Assistant:`` → ``</s> ▁Assistant :``), or
    each Chinese tag and a content (``<|Human|>Hi`` → ``<|Human|> ▁Hi``). A special token that the tokenizer does not
    treat as one (e.g. an eos that is an ordinary word) is not checked.

    Raises:
        ValueError: the ids differ, naming the tokens both ways and the fix (a LLaMA tokenizer loaded with
            ``legacy=False``, the default of current transformers, drops the ``▁``).
    """
    human, assistant = _tags(lang)
    pairs = (
        [(human, _PROBE), (assistant, _PROBE)]
        if lang == "zh"
        else [(tokenizer.eos_token, human), (tokenizer.eos_token, assistant)]
    )
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
                f"The tokenizer encodes {special + text!r} as {tokens(together)}, but the MOSS-RLHF release encoded "
                f"the text after {special!r} as a new text, {tokens(apart)} (its slow SentencePiece LlamaTokenizer, "
                "transformers 4.30). Load the tokenizer with legacy=True, e.g. AutoTokenizer.from_pretrained(path, "
                "legacy=True), so that its prompt ids are the ones the released models were trained on."
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

    The release's rule (``ppo_datahelper.py``), through :func:`trl_ppomax.data.drop_oldest_turns`: whole turns are
    dropped from the start, **one at a time** (what is kept may start with an assistant turn), until
    ``len(tokenizer(format_dialogue(kept, lang, eos), add_special_tokens=add_special_tokens).input_ids)`` fits
    (by default counted with LLaMA's bos, as the release encodes it). ``messages`` must end with a user turn.

    Returns:
        ``messages[k:]`` for the smallest ``k`` that fits (the same dict objects, in a new list), or **None** when
        even the last user turn alone is longer than ``max_tokens``: the caller should keep it whole or skip it
        (as :func:`trl_ppomax.data.prepare_prompt_dataset` does).

    Raises:
        ValueError: ``max_tokens`` is not a positive int, the messages are not a valid prompt (see
            :func:`format_dialogue`), or the tokenizer has no eos token.
    """
    from trl_ppomax.data import drop_oldest_turns

    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}.")
    eos = _eos(tokenizer)
    messages = list(messages)
    format_dialogue(messages, lang, eos)  # validates: alternating, ends with a user turn

    def fits(kept: list[Mapping[str, Any]]) -> bool:
        return _n_tokens(tokenizer, kept, lang, add_special_tokens) <= max_tokens

    kept = drop_oldest_turns(messages, fits)
    if kept is not None and len(kept) < len(messages):
        logger.debug(
            "Dropped the %d oldest turns to fit the prompt in %d tokens.", len(messages) - len(kept), max_tokens
        )
    return kept


def _n_tokens(tokenizer: Any, messages: list[Mapping[str, Any]], lang: str, add_special_tokens: bool = True) -> int:
    prompt = format_dialogue(messages, lang, _eos(tokenizer))
    return len(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])


def build_prompt(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    max_tokens: int | None = None,
    lang: str = "en",
) -> str:
    """The policy's prompt: ``format_dialogue(truncate_dialogue(messages, ...), lang, tokenizer.eos_token)``; with
    ``max_tokens=None`` nothing is dropped. ``tokenizer(prompt)`` gives the release's ids (bos first).

    Raises:
        ValueError: besides :func:`truncate_dialogue`'s errors, when even the last user turn alone is longer than
            ``max_tokens`` (no turn is ever cut: skip such a sample).
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
