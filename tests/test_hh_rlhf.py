"""Anthropic HH-RLHF rows to TRL's conversational preference format (offline, hand-written rows)."""

from __future__ import annotations

import pytest
from datasets import Dataset, DatasetDict
from trl import apply_chat_template, is_conversational, maybe_apply_chat_template

from trl_ppomax.data.hh_rlhf import (
    PREFERENCE_FEATURES,
    convert_hh_rlhf,
    hh_rlhf_to_preference,
    is_hh_rlhf,
    parse_hh_dialogue,
)
from trl_ppomax.toyworld.tiny import build_tokenizer

PROMPT = (
    "\n\nHuman: What is a good name for a cat?"
    "\n\nAssistant: How about Whiskers?"
    "\n\nHuman: Something shorter.\n\nPlease, one word."
)
MULTI_TURN = {
    "chosen": PROMPT + "\n\nAssistant: Tom.",
    "rejected": PROMPT + "\n\nAssistant:  Cats do not need names. ",
}
MULTI_TURN_EXPECTED = {
    "prompt": [
        {"role": "user", "content": "What is a good name for a cat?"},
        {"role": "assistant", "content": "How about Whiskers?"},
        {"role": "user", "content": "Something shorter.\n\nPlease, one word."},
    ],
    "chosen": [{"role": "assistant", "content": "Tom."}],
    "rejected": [{"role": "assistant", "content": "Cats do not need names."}],
}
SINGLE_TURN = {
    "chosen": "\n\nHuman: hello how are you\n\nAssistant: good thanks",
    "rejected": "\n\nHuman: hello how are you\n\nAssistant: bad",
}


def test_multi_turn_row():
    assert hh_rlhf_to_preference(MULTI_TURN) == MULTI_TURN_EXPECTED


def test_single_turn_row_drops_other_keys():
    assert hh_rlhf_to_preference({**SINGLE_TURN, "id": 7}) == {
        "prompt": [{"role": "user", "content": "hello how are you"}],
        "chosen": [{"role": "assistant", "content": "good thanks"}],
        "rejected": [{"role": "assistant", "content": "bad"}],
    }


def test_leading_human_without_newlines():
    row = {key: text.removeprefix("\n\n") for key, text in SINGLE_TURN.items()}
    assert row["chosen"].startswith("Human:")
    assert hh_rlhf_to_preference(row) == hh_rlhf_to_preference(SINGLE_TURN)


def test_empty_assistant_replies_and_markers_inside_turns():
    text = "\n\nHuman: say Human: and Assistant: inline\n\nAssistant:\n\nHuman: again\n\nAssistant:"
    assert parse_hh_dialogue(text) == [
        {"role": "user", "content": "say Human: and Assistant: inline"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("just some text", "No '\\\\n\\\\nHuman:' turn"),
        ("\n\nAssistant: hi", "No '\\\\n\\\\nHuman:' turn"),
        ("", "No '\\\\n\\\\nHuman:' turn"),
        ("preamble\n\nHuman: hi\n\nAssistant: yo", "Text before the first 'Human:' turn"),
        ("\n\nHuman: a\n\nHuman: b\n\nAssistant: c", "turn 1 is 'user'.*expected 'assistant'"),
        ("\n\nHuman: a\n\nAssistant: b\n\nAssistant: c", "turn 2 is 'assistant'.*expected 'user'"),
        ("\n\nHuman: a\n\nAssistant: b\n\nHuman: c", "does not end with an assistant turn"),
    ],
)
def test_parse_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_hh_dialogue(text)


def test_row_errors_name_the_column_and_the_difference():
    with pytest.raises(ValueError, match="'rejected': No '\\\\n\\\\nHuman:' turn"):
        hh_rlhf_to_preference({"chosen": SINGLE_TURN["chosen"], "rejected": "no dialogue here"})
    with pytest.raises(ValueError, match="'rejected' is missing"):
        hh_rlhf_to_preference({"chosen": SINGLE_TURN["chosen"]})
    other_question = {"chosen": SINGLE_TURN["chosen"], "rejected": "\n\nHuman: hi\n\nAssistant: bad"}
    with pytest.raises(ValueError, match=r"same prompt: turn 0 \(user\) differs: chosen has 'hello how are you'"):
        hh_rlhf_to_preference(other_question)
    longer = {"chosen": MULTI_TURN["chosen"], "rejected": SINGLE_TURN["rejected"]}
    with pytest.raises(ValueError, match=r"same prompt: turn 0 .*differs"):
        hh_rlhf_to_preference(longer)
    extra_turns = {
        "chosen": SINGLE_TURN["chosen"],
        "rejected": SINGLE_TURN["chosen"] + "\n\nHuman: hi\n\nAssistant: x",
    }
    with pytest.raises(ValueError, match="chosen has 1 prompt turns, rejected has 3"):
        hh_rlhf_to_preference(extra_turns)


def test_is_hh_rlhf():
    raw = Dataset.from_dict({key: [MULTI_TURN[key], SINGLE_TURN[key]] for key in ("chosen", "rejected")})
    assert is_hh_rlhf(raw)
    assert is_hh_rlhf(raw.add_column("id", [0, 1]))  # extra columns are allowed
    assert is_hh_rlhf(raw.to_iterable_dataset())
    assert is_hh_rlhf(DatasetDict(train=raw, test=raw))
    assert is_hh_rlhf(MULTI_TURN)
    assert is_hh_rlhf({key: text.removeprefix("\n\n") for key, text in SINGLE_TURN.items()})

    assert not is_hh_rlhf(convert_hh_rlhf(raw))  # already converted
    assert not is_hh_rlhf(raw.add_column("prompt", ["a", "b"]))
    assert not is_hh_rlhf(raw.remove_columns("rejected"))
    assert not is_hh_rlhf(raw.select([]))
    assert not is_hh_rlhf(DatasetDict(train=raw, test=convert_hh_rlhf(raw)))
    assert not is_hh_rlhf({"chosen": "good thanks", "rejected": "bad"})
    assert not is_hh_rlhf({"chosen": MULTI_TURN["chosen"], "rejected": None})
    assert not is_hh_rlhf(Dataset.from_dict({"prompt": ["hello"]}))


def test_convert_dataset_is_conversational_and_renders():
    raw = Dataset.from_dict(
        {
            "chosen": [MULTI_TURN["chosen"], SINGLE_TURN["chosen"]],
            "rejected": [MULTI_TURN["rejected"], SINGLE_TURN["rejected"]],
            "source": ["helpful", "harmless"],
        }
    )
    converted = convert_hh_rlhf(raw)
    assert converted.column_names == ["prompt", "chosen", "rejected"]
    assert converted.features == PREFERENCE_FEATURES
    assert converted[0] == MULTI_TURN_EXPECTED
    assert converted[1] == hh_rlhf_to_preference(SINGLE_TURN)

    tokenizer = build_tokenizer()
    for row in converted:
        assert is_conversational(row)
        assert maybe_apply_chat_template(row, tokenizer) == apply_chat_template(row, tokenizer)
    assert apply_chat_template(converted[1], tokenizer) == {
        "prompt": "user: hello how are you </s> assistant: ",
        "chosen": "good thanks </s> ",
        "rejected": "bad </s> ",
    }
    rendered = converted.map(apply_chat_template, fn_kwargs={"processing_class": tokenizer})
    assert rendered[0]["prompt"].startswith("user: What is a good name for a cat? </s> assistant: How about")
    assert rendered[0]["prompt"].endswith("</s> assistant: ")
    assert rendered[0]["chosen"] == "Tom. </s> "
    ids = tokenizer(rendered[1]["prompt"] + rendered[1]["chosen"])["input_ids"]
    assert tokenizer.unk_token_id not in ids


def test_convert_fails_loudly_with_row_index():
    bad = {"chosen": SINGLE_TURN["chosen"], "rejected": "\n\nHuman: hi\n\nAssistant: bad"}
    raw = Dataset.from_list([SINGLE_TURN, MULTI_TURN, bad, SINGLE_TURN])
    with pytest.raises(ValueError, match="HH-RLHF row 2: 'chosen' and 'rejected' do not share the same prompt"):
        convert_hh_rlhf(raw)


def test_convert_empty_dataset_keeps_schema():
    empty = Dataset.from_dict({"chosen": [], "rejected": []})
    converted = convert_hh_rlhf(empty)
    assert len(converted) == 0
    assert converted.features == PREFERENCE_FEATURES
