import logging

import pytest
from jinja2.exceptions import TemplateError
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template
from user_setups import build_llama_style_tokenizer

from trl_ppomax.moss.prompt import (
    SPEAKER_TAGS,
    build_prompt,
    chat_template,
    format_dialogue,
    setup_tokenizer,
    truncate_dialogue,
)
from trl_ppomax.toyworld.tiny import build_tokenizer


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


SINGLE = [user("Hi")]
MULTI = [user("Hi"), assistant("Hello"), user("How?")]
ZH_MULTI = [user("你好"), assistant("你好！"), user("在吗？")]
DIALOGUES = [
    SINGLE,
    MULTI,
    ZH_MULTI,
    [user(" spaces  kept \n"), assistant("\nyes "), user("")],
    [user("Hi"), assistant("Hello")],
    [assistant("Hello"), user("How?")],  # even length: the release's roles from the end start with the assistant
]


@pytest.fixture
def tok_en():
    return setup_tokenizer(build_llama_style_tokenizer("en"), "en")


@pytest.fixture
def tok_zh():
    return setup_tokenizer(build_llama_style_tokenizer("zh"), "zh")


def n_tokens(tokenizer, messages, lang="en"):
    return len(tokenizer(format_dialogue(messages, lang, tokenizer.eos_token)).input_ids)


# ---------------------------------------------------------------- format_dialogue


def test_format_dialogue_exact_strings():
    assert SPEAKER_TAGS == {"en": ("Human:", "Assistant:"), "zh": ("<|Human|>", "<|MOSS|>")}
    assert format_dialogue(SINGLE) == "Human:Hi</s>Assistant:"
    assert format_dialogue(MULTI) == "Human:Hi</s>Assistant:Hello</s>Human:How?</s>Assistant:"
    assert format_dialogue(SINGLE, "zh") == "<|Human|>Hi</s><|MOSS|>"
    assert format_dialogue(ZH_MULTI, "zh") == "<|Human|>你好</s><|MOSS|>你好！</s><|Human|>在吗？</s><|MOSS|>"


def test_format_dialogue_may_start_with_an_assistant_turn():
    # the release tags turns from the end (the last is the human's), so even-length dialogues start with "Assistant:"
    assert format_dialogue([assistant("Hello"), user("How?")]) == "Assistant:Hello</s>Human:How?</s>Assistant:"
    assert (
        format_dialogue([assistant("a"), user("b"), assistant("c"), user("d")], "zh")
        == "<|MOSS|>a</s><|Human|>b</s><|MOSS|>c</s><|Human|>d</s><|MOSS|>"
    )
    assert format_dialogue([assistant("Hello")], add_generation_prompt=False) == "Assistant:Hello</s>"


def test_format_dialogue_without_generation_prompt_and_custom_eos():
    dialogue = [user("Hi"), assistant("Hello")]
    assert format_dialogue(dialogue, add_generation_prompt=False) == "Human:Hi</s>Assistant:Hello</s>"
    assert format_dialogue(dialogue, "zh", add_generation_prompt=False) == "<|Human|>Hi</s><|MOSS|>Hello</s>"
    assert format_dialogue(SINGLE, add_generation_prompt=False) == "Human:Hi</s>"
    assert format_dialogue(SINGLE, eos_token="<eos>") == "Human:Hi<eos>Assistant:"
    # no space after the tag; whitespace next to a special token is dropped, as the release's tokenizer dropped it
    assert format_dialogue([user(" a \n")]) == "Human: a</s>Assistant:"


def test_whitespace_next_to_special_tokens_is_dropped():
    dialogue = [user(" Hi  there \n"), assistant("\tHello "), user("How?\n\n")]
    # English tags are text: only the whitespace before </s> goes
    assert format_dialogue(dialogue) == "Human: Hi  there</s>Assistant:\tHello</s>Human:How?</s>Assistant:"
    # Chinese tags are special tokens: the whitespace after them goes too
    assert format_dialogue(dialogue, "zh") == "<|Human|>Hi  there</s><|MOSS|>Hello</s><|Human|>How?</s><|MOSS|>"
    for lang in ("en", "zh"):
        tokenizer = setup_tokenizer(build_llama_style_tokenizer(lang), lang)
        rendered = tokenizer.apply_chat_template(dialogue, add_generation_prompt=True, tokenize=False)
        assert rendered == "<s>" + format_dialogue(dialogue, lang)


@pytest.mark.parametrize(
    ("messages", "error", "match"),
    [
        ([], ValueError, "empty"),
        ([{"role": "system", "content": "Be nice."}, user("Hi")], ValueError, "no system turn"),
        ([user("Hi"), user("Again")], ValueError, "alternate.*message 1 has role 'user', as message 0"),
        ([assistant("Hello"), user("Hi"), user("Again")], ValueError, "alternate.*message 2 has role 'user'"),
        ([user("Hi"), assistant("a"), assistant("b")], ValueError, "alternate"),
        ([assistant("Hello")], ValueError, "add_generation_prompt=False"),
        ([{"role": "tool", "content": "x"}], ValueError, "only knows 'user' and 'assistant'"),
        ([user("Hi"), assistant("Hello")], ValueError, "add_generation_prompt=False"),
        ([{"role": "user"}], TypeError, "'role' and 'content'"),
        ([user(["Hi"])], TypeError, "must be a str"),
        (user("Hi"), TypeError, "list of"),
    ],
)
def test_format_dialogue_errors(messages, error, match):
    with pytest.raises(error, match=match):
        format_dialogue(messages)


def test_format_dialogue_bad_lang_and_eos():
    with pytest.raises(ValueError, match="Unknown language"):
        format_dialogue(SINGLE, lang="fr")
    with pytest.raises(ValueError, match="eos_token"):
        format_dialogue(SINGLE, eos_token="")


# ---------------------------------------------------------------- chat template


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize(
    ("messages", "add_generation_prompt"),
    # an assistant last turn with a generation prompt is an error, see test_chat_template_errors
    [(m, g) for m in DIALOGUES for g in (True, False) if not (g and m[-1]["role"] == "assistant")],
)
def test_chat_template_matches_format_dialogue(lang, messages, add_generation_prompt):
    tokenizer = setup_tokenizer(build_llama_style_tokenizer(lang), lang)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    text = format_dialogue(messages, lang, tokenizer.eos_token, add_generation_prompt)
    assert rendered == tokenizer.bos_token + text
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_dict=False)
    assert ids == tokenizer(text).input_ids  # the release's ids: one bos, then the text
    assert ids.count(tokenizer.bos_token_id) == 1


def test_chat_template_uses_the_tokenizers_eos(tok_en):
    tok_en.eos_token = "hi"
    assert tok_en.apply_chat_template(MULTI, add_generation_prompt=True, tokenize=False) == "<s>" + format_dialogue(
        MULTI, eos_token="hi"
    )


def test_chat_template_continue_final_message(tok_en):
    rendered = tok_en.apply_chat_template([user("Hi"), assistant("Hel")], continue_final_message=True, tokenize=False)
    assert rendered == "<s>Human:Hi</s>Assistant:Hel"


def test_chat_template_ids_are_the_releases(tok_en):
    text = format_dialogue(MULTI)
    ids = tok_en.apply_chat_template(MULTI, add_generation_prompt=True, return_dict=False)
    assert ids == tok_en(text).input_ids  # the release: tokenizer.encode(prompt, add_special_tokens=True)
    assert ids == [tok_en.bos_token_id, *tok_en(text, add_special_tokens=False).input_ids]


def test_chat_template_without_bos_token():
    (rendered,), _ = render_jinja_template(
        [MULTI], chat_template=chat_template("en"), add_generation_prompt=True, eos_token="</s>"
    )
    assert rendered == format_dialogue(MULTI)


@pytest.mark.parametrize(
    ("messages", "kwargs", "match"),
    [
        ([{"role": "system", "content": "x"}, user("Hi")], {}, "no system turn"),
        ([user("Hi"), user("Again")], {}, "alternate.*message 1 has role user"),
        ([assistant("Hello"), user("Hi"), user("Again")], {}, "alternate.*message 2 has role user"),
        ([user("Hi"), assistant("a"), assistant("b")], {}, "alternate"),
        ([assistant("Hello")], {"add_generation_prompt": True}, "assistant turn"),
        ([{"role": "tool", "content": "x"}], {}, "Unknown role"),
        ([user("Hi"), assistant("Hello")], {"add_generation_prompt": True}, "assistant turn"),
    ],
)
def test_chat_template_errors(tok_en, messages, kwargs, match):
    with pytest.raises(TemplateError, match=match):
        tok_en.apply_chat_template(messages, tokenize=False, **kwargs)


def test_chat_template_accepts_an_assistant_first_dialogue(tok_en):
    messages = [assistant("Hello"), user("How?")]
    assert tok_en.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        "<s>Assistant:Hello</s>Human:How?</s>Assistant:"
    )


def test_chat_template_empty_conversation_raises(tok_en):
    with pytest.raises(ValueError):
        tok_en.apply_chat_template([], add_generation_prompt=True, tokenize=False)


def test_chat_template_unknown_lang():
    with pytest.raises(ValueError, match="Unknown language"):
        chat_template("fr")


# ---------------------------------------------------------------- tokenizers


def test_llama_style_tokenizer_shape():
    tokenizer = build_llama_style_tokenizer()
    assert (tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert 200 <= len(tokenizer) <= 500
    ids = tokenizer("Human:Hi</s>Assistant:Hello, Qwerty 42 你好").input_ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert ids[-1] != tokenizer.eos_token_id
    assert tokenizer.unk_token_id not in ids  # any ASCII word falls back to letters
    assert tokenizer.convert_ids_to_tokens(ids)[:5] == ["<s>", "Human", ":", "Hi", "</s>"]
    assert build_llama_style_tokenizer("zh").get_vocab() == tokenizer.get_vocab()
    with pytest.raises(ValueError, match="Unknown language"):
        build_llama_style_tokenizer("fr")


def test_setup_tokenizer_en(tok_en):
    assert tok_en.pad_token == "<unk>" and tok_en.pad_token_id == 0
    assert tok_en.padding_side == "left"
    assert tok_en.chat_template == chat_template("en")
    batch = tok_en(["hi", "how are you"], padding=True).input_ids
    assert batch[0][:2] == [0, 0] and batch[0][2:] == tok_en("hi").input_ids
    assert "<|Human|>" not in tok_en.get_vocab()


def test_setup_tokenizer_zh_adds_unsplit_special_tokens():
    tokenizer = build_llama_style_tokenizer("zh")
    n = len(tokenizer)
    assert len(tokenizer("<|Human|>hi").input_ids) > 3  # split into pieces before setup
    assert setup_tokenizer(tokenizer, "zh") is tokenizer
    assert len(tokenizer) == n + 2
    assert tokenizer.convert_tokens_to_ids(["<|Human|>", "<|MOSS|>"]) == [n, n + 1]
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("<|Human|>hi").input_ids)
    assert tokens == ["<s>", "<|Human|>", "hi"]
    ids = tokenizer(format_dialogue(ZH_MULTI, "zh")).input_ids
    assert ids.count(n) == 2 and ids.count(n + 1) == 2
    assert {"<|Human|>", "<|MOSS|>"} <= set(tokenizer.all_special_tokens)
    assert tokenizer.decode(tokenizer("<|Human|>hi<|MOSS|>").input_ids, skip_special_tokens=True) == "hi"
    assert tokenizer.pad_token_id == 0 and tokenizer.padding_side == "left"


def test_setup_tokenizer_is_idempotent(tok_zh):
    before = (len(tok_zh), tok_zh.get_vocab(), list(tok_zh.all_special_tokens), tok_zh.chat_template)
    setup_tokenizer(tok_zh, "zh")
    assert (len(tok_zh), tok_zh.get_vocab(), list(tok_zh.all_special_tokens), tok_zh.chat_template) == before
    en = build_llama_style_tokenizer()
    setup_tokenizer(setup_tokenizer(en, "en"), "en")
    assert len(en) == len(build_llama_style_tokenizer()) and en.pad_token_id == 0


def test_setup_tokenizer_survives_save_and_load(tok_zh, tmp_path):
    tok_zh.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.pad_token_id == 0 and loaded.padding_side == "left"
    assert loaded.chat_template == chat_template("zh")
    assert loaded("<|Human|>hi").input_ids == tok_zh("<|Human|>hi").input_ids
    assert loaded.apply_chat_template(ZH_MULTI, add_generation_prompt=True, tokenize=False) == "<s>" + format_dialogue(
        ZH_MULTI, "zh"
    )


def test_setup_tokenizer_needs_unk():
    with pytest.raises(ValueError, match="<unk>"):
        setup_tokenizer(build_tokenizer())  # the other tiny tokenizer has [UNK], not <unk>


def test_setup_tokenizer_warns_on_other_eos(caplog):
    tokenizer = build_llama_style_tokenizer()
    tokenizer.eos_token = "hi"
    with caplog.at_level(logging.WARNING, logger="trl_ppomax.moss.prompt"):
        setup_tokenizer(tokenizer)
    assert "eos token is 'hi'" in caplog.text
    with pytest.raises(ValueError, match="Unknown language"):
        setup_tokenizer(tokenizer, "fr")


# ---------------------------------------------------------------- truncation

LONG = [
    user("hello"),
    assistant("hi"),
    user("how are you today"),
    assistant("good thanks"),
    user("tell me a story about the cat"),
]


def test_truncate_keeps_everything_when_it_fits(tok_en):
    full = n_tokens(tok_en, LONG)
    assert truncate_dialogue(LONG, tok_en, full) == LONG
    assert truncate_dialogue(LONG, tok_en, 10_000) == LONG


def test_truncate_drops_whole_turns_one_at_a_time(tok_en):
    sizes = [n_tokens(tok_en, LONG[k:]) for k in range(len(LONG))]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    for budget in range(sizes[-1], sizes[0] + 2):
        kept = truncate_dialogue(LONG, tok_en, budget)
        k = next(k for k, size in enumerate(sizes) if size <= budget)  # the fewest turns dropped that fit
        assert kept == LONG[k:]
        assert all(a is b for a, b in zip(kept, LONG[k:], strict=True))  # whole turns, never a cut inside one
        assert n_tokens(tok_en, kept) <= budget
    # dropping one turn leaves an assistant turn first, as the release does
    kept = truncate_dialogue(LONG, tok_en, sizes[1])
    assert kept == LONG[1:] and kept[0]["role"] == "assistant"
    assert format_dialogue(kept).startswith("Assistant:hi</s>Human:how are you today</s>")
    assert truncate_dialogue(LONG, tok_en, sizes[2] - 1) == LONG[3:]


def test_truncate_returns_none_when_the_last_turn_alone_does_not_fit(tok_en):
    alone = n_tokens(tok_en, LONG[-1:])
    assert truncate_dialogue(LONG, tok_en, alone) == [LONG[-1]]
    for budget in (1, 6, alone - 1):
        assert truncate_dialogue(LONG, tok_en, budget) is None  # the caller skips the sample
    assert LONG[-1]["content"] == "tell me a story about the cat"  # input untouched


def test_truncate_uses_the_generic_release_rule(tok_en, monkeypatch):
    import trl_ppomax.data

    calls = []
    original = trl_ppomax.data.drop_oldest_turns

    def spy(messages, fits):
        calls.append(messages)
        return original(messages, fits)

    monkeypatch.setattr(trl_ppomax.data, "drop_oldest_turns", spy)
    assert truncate_dialogue(LONG, tok_en, n_tokens(tok_en, LONG[2:])) == LONG[2:]
    assert calls == [LONG]


def test_truncate_counts_bos_unless_told(tok_en):
    size = n_tokens(tok_en, LONG)
    assert truncate_dialogue(LONG, tok_en, size - 1) == LONG[1:]
    assert truncate_dialogue(LONG, tok_en, size - 1, add_special_tokens=False) == LONG


def test_truncate_zh(tok_zh):
    dialogue = [user("你好"), assistant("你好！"), user("今天猫在吗？")]
    assert n_tokens(tok_zh, [user("")], "zh") == 4  # <s> <|Human|> </s> <|MOSS|>
    full = n_tokens(tok_zh, dialogue, "zh")
    assert truncate_dialogue(dialogue, tok_zh, full, "zh") == dialogue
    assert truncate_dialogue(dialogue, tok_zh, full - 1, "zh") == dialogue[1:]
    assert truncate_dialogue(dialogue, tok_zh, n_tokens(tok_zh, dialogue[1:], "zh") - 1, "zh") == dialogue[2:]
    assert truncate_dialogue(dialogue, tok_zh, n_tokens(tok_zh, dialogue[2:], "zh") - 1, "zh") is None


def test_truncate_accepts_an_assistant_first_dialogue(tok_en):
    dialogue = LONG[1:]
    assert truncate_dialogue(dialogue, tok_en, n_tokens(tok_en, dialogue)) == dialogue
    assert truncate_dialogue(dialogue, tok_en, n_tokens(tok_en, dialogue) - 1) == LONG[2:]


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None])
def test_truncate_bad_budget(tok_en, bad):
    with pytest.raises(ValueError, match="positive int"):
        truncate_dialogue(LONG, tok_en, bad)


def test_truncate_validates_messages(tok_en):
    with pytest.raises(ValueError, match="assistant turn"):
        truncate_dialogue(LONG[:4], tok_en, 100)
    with pytest.raises(ValueError, match="alternate"):
        truncate_dialogue([*LONG, user("again")], tok_en, 100)
    with pytest.raises(ValueError, match="no system turn"):
        truncate_dialogue([{"role": "system", "content": "x"}, *LONG], tok_en, 100)
    with pytest.raises(ValueError, match="empty"):
        truncate_dialogue([], tok_en, 100)


# ---------------------------------------------------------------- build_prompt


def test_build_prompt(tok_en, tok_zh):
    assert build_prompt(LONG, tok_en) == format_dialogue(LONG)
    assert build_prompt(LONG, tok_en, max_tokens=n_tokens(tok_en, LONG[2:])) == (
        "Human:how are you today</s>Assistant:good thanks</s>Human:tell me a story about the cat</s>Assistant:"
    )
    assert build_prompt(LONG, tok_en, max_tokens=n_tokens(tok_en, LONG[1:])) == (
        "Assistant:hi</s>Human:how are you today</s>Assistant:good thanks</s>Human:tell me a story about the cat"
        "</s>Assistant:"
    )
    assert (
        build_prompt(ZH_MULTI, tok_zh, lang="zh") == "<|Human|>你好</s><|MOSS|>你好！</s><|Human|>在吗？</s><|MOSS|>"
    )
    prompt = build_prompt(LONG, tok_en, max_tokens=15)
    assert prompt == format_dialogue(LONG[-1:]) and len(tok_en(prompt).input_ids) <= 15


def test_build_prompt_raises_when_the_last_turn_alone_is_too_long(tok_en):
    alone = n_tokens(tok_en, LONG[-1:])
    assert build_prompt(LONG, tok_en, max_tokens=alone) == format_dialogue(LONG[-1:])
    with pytest.raises(ValueError, match=rf"takes {alone} tokens.*max_tokens={alone - 1}"):
        build_prompt(LONG, tok_en, max_tokens=alone - 1)
