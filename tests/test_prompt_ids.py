"""The trainer's prompt ids are the MOSS-RLHF release's: one BOS, roles from the end, whole oldest turns dropped.

The release (``ppo/ppo_datahelper.py``) tags turns from the end (the last is the human's), builds
``eos.join(tagged turns) + eos + assistant tag``, encodes it with ``tokenizer.encode(prompt, add_special_tokens=True)``
(LLaMA's BOS first) and, while too long, drops the oldest turn and re-encodes. :func:`release_ids` re-implements that
here, independently of :func:`trl_ppomax.moss.prompt.format_dialogue`.
"""

import json

import pytest
from datasets import Dataset

from trl_ppomax.data import load_any_dataset, prepare_prompt_dataset, tokenize_prompt
from trl_ppomax.moss.prompt import SPEAKER_TAGS, format_dialogue, setup_tokenizer
from trl_ppomax.tiny import build_llama_style_tokenizer


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def release_ids(turns, tokenizer, lang, budget=None):
    """``ppo_datahelper.py``: tags from the end, ``encode(..., add_special_tokens=True)``, oldest turns dropped."""
    human, bot = SPEAKER_TAGS[lang]
    eos = tokenizer.eos_token
    tagged = [(human, bot)[(i + (len(turns) + 1)) % 2] + turn for i, turn in enumerate(turns)]

    def encode(context):
        return tokenizer.encode(eos.join(context) + eos + bot, add_special_tokens=True)

    ids = encode(tagged)
    while budget is not None and len(ids) > budget and len(tagged) > 1:
        tagged = tagged[1:]
        ids = encode(tagged)
    return ids


def trainer_ids(prompt, tokenizer, **kwargs):
    return prepare_prompt_dataset(Dataset.from_dict({"prompt": [prompt]}), tokenizer, **kwargs)["input_ids"][0]


@pytest.fixture(params=["en", "zh"])
def lang_tok(request):
    lang = request.param
    return lang, setup_tokenizer(build_llama_style_tokenizer(lang), lang)


TEXTS = {
    "en": ["Hi", "Hello there", "How are you?", "good thanks", "tell me a story"],
    "zh": ["你好", "你好！", "在吗？", "好", "猫"],
}


@pytest.mark.parametrize("n_turns", [1, 2, 3, 4])  # 2 and 4: even length, so the dialogue starts with the assistant
def test_trainer_ids_are_the_release_ids(lang_tok, n_turns):
    lang, tokenizer = lang_tok
    turns = TEXTS[lang][-n_turns:]
    messages = [(user if (n_turns - 1 - i) % 2 == 0 else assistant)(t) for i, t in enumerate(turns)]
    assert messages[-1]["role"] == "user" and messages[0]["role"] == ("assistant" if n_turns % 2 == 0 else "user")
    ids = trainer_ids(messages, tokenizer)
    assert ids == tokenizer(format_dialogue(messages, lang, tokenizer.eos_token))["input_ids"]
    assert ids == release_ids(turns, tokenizer, lang)
    assert ids == tokenize_prompt(messages, tokenizer)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert ids.count(tokenizer.eos_token_id) == n_turns


def test_plain_text_prompt_gets_the_tokenizers_bos(lang_tok):
    lang, tokenizer = lang_tok
    text = format_dialogue([user(TEXTS[lang][0])], lang)
    ids = trainer_ids(text, tokenizer)
    assert ids == tokenizer(text)["input_ids"] == release_ids(TEXTS[lang][:1], tokenizer, lang)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    # a text that already starts with the bos does not get a second one
    assert trainer_ids(tokenizer.bos_token + text, tokenizer) == ids


def test_a_template_writing_bos_gets_one_bos():
    tokenizer = build_llama_style_tokenizer()
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    messages = [user("Hi"), assistant("Hello"), user("How are you?")]
    ids = trainer_ids(messages, tokenizer)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<s>user: Hi</s>")
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


def test_input_ids_datasets_stay_untouched(lang_tok):
    _, tokenizer = lang_tok
    rows = [[5, 6, 7], [1, 1, 9], [3]]
    dataset = Dataset.from_dict({"input_ids": rows, "other": ["a", "b", "c"]})
    prepared = prepare_prompt_dataset(dataset, tokenizer)
    assert prepared["input_ids"] == rows  # untouched; the other columns are kept for reward functions
    assert prepared["other"] == ["a", "b", "c"]


def test_release_prompt_file(lang_tok, tmp_path):
    lang, tokenizer = lang_tok
    q, a, long_question = ("q", "a", "tell me a story about the cat") if lang == "en" else ("问", "答", "今天猫在吗？")
    dialogues = [[q, a], ["hello", "hi", long_question]]
    path = tmp_path / "train.json"
    path.write_text(json.dumps(dialogues, ensure_ascii=False), encoding="utf-8")

    dataset = load_any_dataset(str(path))
    assert dataset["prompt"][0] == [assistant(q), user(a)]  # roles from the end: the last turn is the human's
    assert dataset["prompt"][1] == [user("hello"), assistant("hi"), user(long_question)]

    full = release_ids(dialogues[1], tokenizer, lang)
    without_oldest = release_ids(dialogues[1][1:], tokenizer, lang)
    budget = len(without_oldest)
    assert len(release_ids(dialogues[0], tokenizer, lang)) <= budget < len(full)  # only the oldest turn must go

    ids = prepare_prompt_dataset(dataset, tokenizer, max_prompt_length=budget)["input_ids"]
    assert ids[0] == release_ids(dialogues[0], tokenizer, lang, budget)
    assert ids[1] == release_ids(dialogues[1], tokenizer, lang, budget) == without_oldest
    assert ids[1] == tokenizer(format_dialogue([assistant("hi"), user(long_question)], lang))["input_ids"]
    assert all(row.count(tokenizer.bos_token_id) == 1 for row in ids)
