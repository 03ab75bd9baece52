"""The trainer's prompt ids are the MOSS-RLHF release's: one BOS, roles from the end, whole oldest turns dropped.

The release (``ppo/ppo_datahelper.py``) tags turns from the end (the last is the human's), builds
``eos.join(tagged turns) + eos + assistant tag``, encodes it with ``tokenizer.encode(prompt, add_special_tokens=True)``
(LLaMA's BOS first) and, while too long, drops the oldest turn and re-encodes. :func:`release_ids` re-implements that
here, independently of :func:`trl_ppomax.moss.prompt.format_dialogue`.
"""

import io
import json
import logging
import re

import pytest
from datasets import Dataset
from transformers import LlamaTokenizer, LlamaTokenizerFast
from user_setups import build_llama_style_tokenizer

from trl_ppomax.data import prepare_prompt_dataset, tokenize_prompt
from trl_ppomax.moss.data import load_dataset_or_release, release_files
from trl_ppomax.moss.prompt import SPEAKER_TAGS, format_dialogue, setup_tokenizer


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def roles(turns):
    """Messages for a release sample: roles from the end."""
    return [(user if (len(turns) - 1 - i) % 2 == 0 else assistant)(t) for i, t in enumerate(turns)]


def release_text(turns, lang, eos="</s>"):
    """``ppo_datahelper.py``'s prompt string: tags from the end, turns joined by eos, then eos and the assistant tag."""
    human, bot = SPEAKER_TAGS[lang]
    tagged = [(human, bot)[(i + (len(turns) + 1)) % 2] + turn for i, turn in enumerate(turns)]
    return eos.join(tagged) + eos + bot


def release_ids(turns, tokenizer, lang, budget=None):
    """``ppo_datahelper.py``: ``encode(release_text, add_special_tokens=True)``, oldest turns dropped while too long."""
    ids = tokenizer.encode(release_text(turns, lang, tokenizer.eos_token), add_special_tokens=True)
    while budget is not None and len(ids) > budget and len(turns) > 1:
        turns = turns[1:]
        ids = tokenizer.encode(release_text(turns, lang, tokenizer.eos_token), add_special_tokens=True)
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

    dataset = load_dataset_or_release(str(path))
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


# ---------------------------------------------------------------- prompts longer than the budget, empty turns
def test_an_over_long_last_turn_is_kept_whole_when_it_fits(caplog):
    tokenizer = setup_tokenizer(build_llama_style_tokenizer("en"), "en")
    long_turn = "tell me a story about the cat " * 4
    dialogues = [["hi"], ["hello", "hi", long_turn]]
    alone = release_ids([long_turn], tokenizer, "en")  # the release keeps the last turn alone, whole
    budget = len(alone) - 5
    assert len(release_ids(dialogues[0], tokenizer, "en")) <= budget
    dataset = Dataset.from_dict({"prompt": [roles(d) for d in dialogues]})
    with caplog.at_level(logging.WARNING, logger="trl_ppomax.data"):
        ids = prepare_prompt_dataset(dataset, tokenizer, max_prompt_length=budget, max_kept_length=len(alone))
    assert ids["input_ids"] == [release_ids(dialogues[0], tokenizer, "en"), alone]
    assert ids["input_ids"][1][:3] == tokenizer.convert_tokens_to_ids(["<s>", "Human", ":"])  # never cut
    assert "1 of 2 prompts are longer than" in caplog.text and "1 kept whole" in caplog.text


def test_an_over_long_prompt_that_does_not_fit_is_skipped_and_counted(caplog):
    tokenizer = setup_tokenizer(build_llama_style_tokenizer("en"), "en")
    long_turn = "tell me a story about the cat " * 4
    dialogues = [["hi"], ["hello", "hi", long_turn], [long_turn + "again"], ["how are you"]]
    alone = release_ids([long_turn], tokenizer, "en")
    dataset = Dataset.from_dict({"prompt": [roles(d) for d in dialogues], "row": [0, 1, 2, 3]})
    with caplog.at_level(logging.WARNING, logger="trl_ppomax.data"):
        kept = prepare_prompt_dataset(dataset, tokenizer, max_prompt_length=20, max_kept_length=len(alone) - 1)
    assert kept["row"] == [0, 3]  # the other columns follow their prompts
    assert kept["input_ids"] == [release_ids(dialogues[i], tokenizer, "en") for i in (0, 3)]
    assert "2 of 4 prompts are longer than 20 tokens" in caplog.text
    assert "0 kept whole" in caplog.text and "2 skipped" in caplog.text
    with pytest.raises(ValueError, match="none is left"):
        prepare_prompt_dataset(dataset.select([1, 2]), tokenizer, max_prompt_length=20, max_kept_length=30)
    with pytest.raises(ValueError, match=r"2 of 4 prompts are longer than 20 tokens.*truncate_long_prompts=True"):
        prepare_prompt_dataset(dataset, tokenizer, max_prompt_length=20, max_kept_length=100, truncate=False)


def test_text_prompts_and_ids_are_never_cut():
    tokenizer = setup_tokenizer(build_llama_style_tokenizer("en"), "en")
    text = format_dialogue([user("tell me a story about the cat " * 4)])
    full, short = tokenizer(text)["input_ids"], tokenizer("hi")["input_ids"]
    for dataset in (Dataset.from_dict({"prompt": [text, "hi"]}), Dataset.from_dict({"input_ids": [full, short]})):
        kept = prepare_prompt_dataset(dataset, tokenizer, max_prompt_length=10, max_kept_length=len(full))
        assert kept["input_ids"] == [full, short]  # whole: its BOS and tag first
        skipped = prepare_prompt_dataset(dataset, tokenizer, max_prompt_length=10, max_kept_length=len(full) - 1)
        assert skipped["input_ids"] == [short]


@pytest.mark.parametrize("empty", ["", "  \n", None])
def test_conversations_with_an_empty_turn_are_dropped_and_counted(empty, caplog):
    tokenizer = setup_tokenizer(build_llama_style_tokenizer("en"), "en")
    prompts = [[user("hi")], [user("hello"), assistant(empty), user("how are you")], [user(empty)], [user("cat")]]
    dataset = Dataset.from_dict({"prompt": prompts, "row": [0, 1, 2, 3]})
    with caplog.at_level(logging.WARNING, logger="trl_ppomax.data"):
        kept = prepare_prompt_dataset(dataset, tokenizer, name="train_dataset")
    assert kept["row"] == [0, 3]
    assert "train_dataset: 2 of 4 conversations have an empty message" in caplog.text
    with pytest.raises(ValueError, match="no prompt is left"):
        prepare_prompt_dataset(dataset.select([1, 2]), tokenizer)


# ---------------------------------------------------------------- the release's data files
def write_json(path, data):
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def test_a_release_data_folder_loads_as_one_train_and_one_eval_dataset(tmp_path, caplog):
    write_json(tmp_path / "b_train.json", [["q2", "a2", "q3"], ["x", ""]])
    write_json(tmp_path / "a_train.json", [["q1"]])
    write_json(tmp_path / "valid.json", [["v1"], [" ", "v2"], ["v3", None]])
    write_json(tmp_path / "notes.json", {"not": "data"})
    assert release_files(str(tmp_path)) == [str(tmp_path / "a_train.json"), str(tmp_path / "b_train.json")]
    with caplog.at_level(logging.WARNING, logger="trl_ppomax.data"):
        train = load_dataset_or_release(str(tmp_path))
        evaluation = load_dataset_or_release(str(tmp_path), split="valid")
    assert train["prompt"] == [roles(["q1"]), roles(["q2", "a2", "q3"])]  # sorted files, roles from the end
    assert evaluation["prompt"] == [roles(["v1"])]
    assert load_dataset_or_release(str(tmp_path), split="validation")["prompt"] == evaluation["prompt"]
    assert "b_train.json: dropped 1 of 2 samples with no turns or an empty one" in caplog.text
    assert "valid.json: dropped 2 of 3 samples" in caplog.text


def test_the_release_ptx_format_loads_as_dialogues(tmp_path):
    path = tmp_path / "ptx_train.json"
    write_json(path, [["q", "a"], ["q", "a", "q2", "a2"], ["alone"], ["q", ""]])
    ptx = load_dataset_or_release(str(path), kind="ptx")
    # roles from the start, the human's first (ppo_datahelper.PPOSFTDataset); fewer than two turns or an empty one:
    # dropped, as the release does
    assert ptx["messages"] == [
        [user("q"), assistant("a")],
        [user("q"), assistant("a"), user("q2"), assistant("a2")],
    ]
    tokenizer = setup_tokenizer(build_llama_style_tokenizer("en"), "en")
    from trl_ppomax.data import prepare_text_dataset

    row = prepare_text_dataset(ptx, tokenizer, num_proc=None)[0]
    assert row["input_ids"] == tokenizer("Human:q</s>Assistant:a</s>")["input_ids"]  # BOS + the release's text
    tokens = tokenizer.convert_ids_to_tokens(row["input_ids"])
    assert [t for t, m in zip(tokens, row["loss_mask"], strict=True) if m] == ["Assistant", ":", "a", "</s>"]
    assert load_dataset_or_release(str(path))["prompt"][0] == roles(["q", "a"])  # as prompts: roles from the end


def test_the_recipe_reads_a_release_folder(tmp_path):
    from trl_ppomax.cli.ppo import PPOMaxScriptArguments, load_prompts

    write_json(tmp_path / "train.json", [["q1"], ["q2"], ["q3"]])
    write_json(tmp_path / "valid.json", [["v1"], ["v2"]])
    train, evaluation = load_prompts(PPOMaxScriptArguments(dataset_name=str(tmp_path)))
    assert train["prompt"] == [roles([q]) for q in ("q1", "q2", "q3")]
    assert evaluation["prompt"] == [roles(["v1"]), roles(["v2"])]
    other = tmp_path / "other_valid.json"
    write_json(other, [["w"]])
    _, evaluation = load_prompts(PPOMaxScriptArguments(dataset_name=str(tmp_path), eval_dataset_name=str(other)))
    assert evaluation["prompt"] == [roles(["w"])]
    train, evaluation = load_prompts(PPOMaxScriptArguments(dataset_name=str(tmp_path / "train.json")))
    assert len(train) == 3 and evaluation is None  # a single file: no evaluation split of its own


# ---------------------------------------------------------------- a SentencePiece LLaMA tokenizer, as released
SP_CORPUS = [
    "Human: Hello there, how are you today?",
    "Assistant: I am fine, thanks. How can I help you?",
    "Human:Tell me a story about a cat.",
    "Assistant:Once upon a time a cat sat on a mat.",
    "你好，在吗？ 我很好，谢谢。",
    "The quick brown fox jumps over the lazy dog 12345.",
]


@pytest.fixture(scope="module")
def sentencepiece_llama(tmp_path_factory):
    """A LLaMA-style SentencePiece model trained here (BPE, byte fallback, split digits, ``▁`` dummy prefix, identity
    normalisation, ``<unk>`` 0 / ``<s>`` 1 / ``</s>`` 2), saved as a LLaMA tokenizer folder: ``(folder, processor)``."""
    spm = pytest.importorskip("sentencepiece")
    pytest.importorskip("google.protobuf", reason="transformers reads tokenizer.model with protobuf")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SP_CORPUS * 20),
        model_writer=model,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        add_dummy_prefix=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        hard_vocab_limit=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    folder = tmp_path_factory.mktemp("sentencepiece_llama")
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False}
    write_json(
        folder / "tokenizer_config.json", {**config, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    )
    return folder, spm.SentencePieceProcessor(model_proto=model.getvalue())


def slow_release_encode(processor, text, special_ids):
    """What the release's tokenizer gave for ``text`` (transformers 4.30's slow ``LlamaTokenizer.encode(text,
    add_special_tokens=True)``, its special tokens set as plain strings): the text split on the special tokens, the
    whitespace next to each stripped, every other piece SentencePiece-encoded on its own (with its ``▁`` prefix),
    BOS first."""
    pieces = re.split("(" + "|".join(map(re.escape, special_ids)) + ")", text)
    for i, piece in enumerate(pieces):
        if piece in special_ids:
            if i > 0:
                pieces[i - 1] = pieces[i - 1].rstrip()
            if i + 1 < len(pieces):
                pieces[i + 1] = pieces[i + 1].lstrip()
    ids = [processor.bos_id()]
    for piece in pieces:
        ids.extend([special_ids[piece]] if piece in special_ids else processor.encode(piece) if piece else [])
    return ids


SP_TURNS = {
    "en": [" Hello there \n", "\tI am fine, thanks. ", "Tell me a story about a cat.  "],
    "zh": ["你好 ", " 在吗？\n", "  我很好，谢谢。 "],
}


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_prompt_ids_are_the_release_sentencepiece_ids(sentencepiece_llama, lang):
    folder, processor = sentencepiece_llama
    tokenizer = setup_tokenizer(LlamaTokenizer.from_pretrained(folder, legacy=True), lang)
    turns = SP_TURNS[lang]
    specials = {t: tokenizer.convert_tokens_to_ids(t) for t in ["</s>", *(SPEAKER_TAGS["zh"] if lang == "zh" else ())]}
    expected = slow_release_encode(processor, release_text(turns, lang), specials)
    assert tokenize_prompt(roles(turns), tokenizer) == expected  # the chat template
    assert tokenizer(format_dialogue(roles(turns), lang))["input_ids"] == expected  # the formatted text
    tokens = tokenizer.convert_ids_to_tokens(expected)
    markers = ["</s>"] if lang == "en" else list(SPEAKER_TAGS["zh"])
    after = [tokens[i + 1] for i, t in enumerate(tokens[:-1]) if t in markers]
    assert len(after) == 3 and all(t.startswith("▁") for t in after)  # a new text: ▁ first
    before_eos = {tokens[i - 1] for i, t in enumerate(tokens) if t == "</s>"}
    assert not before_eos & {"▁", "<0x0A>", "<0x09>"}  # the whitespace before </s> is gone, as in the release


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("cls", [LlamaTokenizer, LlamaTokenizerFast], ids=["LlamaTokenizer", "LlamaTokenizerFast"])
@pytest.mark.parametrize("legacy", [True, False])
def test_setup_tokenizer_refuses_a_tokenizer_that_differs_from_the_release(sentencepiece_llama, lang, cls, legacy):
    folder, _ = sentencepiece_llama
    tokenizer = cls.from_pretrained(folder, legacy=legacy)
    if legacy:
        setup_tokenizer(tokenizer, lang)  # text after </s> (or a Chinese tag) gets its ▁, as in the release
    else:  # current transformers' default: no ▁ after a special token
        with pytest.raises(ValueError, match=r"as a new text.*Load the tokenizer with legacy=True"):
            setup_tokenizer(tokenizer, lang)


def test_the_recipe_loads_a_moss_tokenizer_as_released(sentencepiece_llama, tmp_path):
    from transformers import AutoTokenizer

    from trl_ppomax.cli.ppo import load_tokenizer

    folder, _ = sentencepiece_llama
    with pytest.raises(ValueError, match="legacy=True"):  # current transformers' default load
        setup_tokenizer(AutoTokenizer.from_pretrained(folder), "en")
    tokenizer = load_tokenizer(str(folder), "moss_en")
    assert (
        tokenizer("</s>Assistant:", add_special_tokens=False)["input_ids"][1:]
        == tokenizer("Assistant:")["input_ids"][1:]
    )
    build_llama_style_tokenizer("zh").save_pretrained(tmp_path)  # a tokenizer without a legacy mode loads too
    assert (
        load_tokenizer(str(tmp_path), "moss_zh").chat_template
        == setup_tokenizer(build_llama_style_tokenizer("zh"), "zh").chat_template
    )


def test_a_set_up_tokenizer_reloads_as_released(sentencepiece_llama, tmp_path):
    from transformers import AutoTokenizer

    folder, _ = sentencepiece_llama
    setup_tokenizer(LlamaTokenizer.from_pretrained(folder, legacy=True), "zh").save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)  # no legacy argument: the saved config says it
    tokens = setup_tokenizer(reloaded, "zh").convert_ids_to_tokens(reloaded("<|Human|>Hi")["input_ids"])
    assert tokens[1] == "<|Human|>" and tokens[2].startswith("▁")
