"""The multiple-choice scorer (trl_ppomax.judging.mcq) on tiny models built in code: accuracies known by
construction, scores checked against plain per-question forward passes."""

import json

import pytest
import torch
from datasets import Dataset, DatasetDict
from transformers import LlamaForCausalLM
from user_setups import build_llama_style_tokenizer

from trl_ppomax.judging.mcq import (
    MMLU_INSTRUCTION,
    Question,
    build_prompt,
    compare_multiple_choice,
    read_questions,
    score_multiple_choice,
    select_shots,
)
from trl_ppomax.toyworld.tiny import SPECIALS, WORDS, llama_config, word_level_tokenizer

LETTER_TOKENS = ["A", "B", "C", "D", "A.", "B.", "C.", "D.", "Answer:"]

# Answers B, B, A, C, B: a model that always says "B" gets 3/5; astronomy 1/2 (B, A), zoology 2/3 (B, C, B).
MMLU_ROWS = [
    {"question": "what is the sun", "choices": ["a dog", "great", "the moon and the sun", "no"], "answer": 1,
     "subject": "astronomy"},
    {"question": "what is a cat", "choices": ["the moon", "a cat", "very sad", "it is a dog"], "answer": 1,
     "subject": "zoology"},
    {"question": "why is the moon nice", "choices": ["it is", "no", "so much more", "but"], "answer": 0,
     "subject": "astronomy"},
    {"question": "how is a dog today", "choices": ["bad", "sad", "very happy today", "good"], "answer": 2,
     "subject": "zoology"},
    {"question": "is the cat happy", "choices": ["no", "yes", "what", "less and less"], "answer": 1,
     "subject": "zoology"},
]  # fmt: skip
FEW_SHOT_ROWS = [
    {"question": "is the sun hot", "choices": ["yes", "no", "so", "or"], "answer": 0, "subject": "astronomy"},
    {"question": "is the dog sad", "choices": ["yes", "no", "so", "or"], "answer": 1, "subject": "zoology"},
    {"question": "is the moon long", "choices": ["yes", "no", "so", "or"], "answer": 1, "subject": "astronomy"},
    {"question": "is a cat good", "choices": ["yes", "no", "so", "or"], "answer": 2, "subject": "zoology"},
    {"question": "what moon", "choices": ["yes", "no", "so", "or"], "answer": 3, "subject": "astronomy"},
]
QUIET = {"progress": False}


def ceval_rows(rows):
    """The same questions in C-Eval's layout: one column per choice, a letter answer, no subject column."""
    return [
        {"question": r["question"], **dict(zip("ABCD", r["choices"], strict=True)), "answer": "ABCD"[r["answer"]]}
        for r in rows
    ]


def tokenizer_for_tests():
    return word_level_tokenizer([*SPECIALS, *WORDS, *LETTER_TOKENS])


def tiny_model(tokenizer, seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(tokenizer, max_position_embeddings=512)).eval()


def always(model, token_id):
    """Make ``model`` predict ``token_id`` at every position: the layers add nothing to the residual stream, the
    embeddings' coordinate 0 is 1 (so the normed hidden state is (c > 0, 0, ...)), and only ``token_id``'s output
    row reads it. Survives save_pretrained (weights only)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[token_id, 0] = 10.0
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizer_for_tests()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model(tokenizer)


@torch.no_grad()
def plain_letter_scores(model, tokenizer, prompt):
    """log p(letter | prompt) for A-D from one unpadded forward pass."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    logprobs = model(ids).logits[0, -1].log_softmax(-1)
    return [logprobs[tokenizer.convert_tokens_to_ids(letter)].item() for letter in "ABCD"]


@torch.no_grad()
def plain_mean_loglikelihood(model, tokenizer, context, text):
    """Mean log p(token | everything before) over the tokens of " <text>" after ``context``, from one forward pass."""
    context_ids = tokenizer(context).input_ids
    ids = tokenizer(context + " " + text).input_ids
    assert ids[: len(context_ids)] == context_ids
    logprobs = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    picked = logprobs.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return picked[len(context_ids) - 1 :].mean().item()


def test_accuracy_of_a_model_that_always_says_b(tokenizer):
    model = always(tiny_model(tokenizer), tokenizer.convert_tokens_to_ids("B"))
    report, predictions = score_multiple_choice(model, tokenizer, Dataset.from_list(MMLU_ROWS), **QUIET)
    assert [p["prediction"] for p in predictions] == ["B"] * 5
    assert [p["answer"] for p in predictions] == ["B", "B", "A", "C", "B"]
    assert [p["correct"] for p in predictions] == [True, True, False, False, True]
    assert report["all"] == {"accuracy": 3 / 5, "correct": 3, "n": 5}
    assert report["subjects"] == {
        "astronomy": {"accuracy": 1 / 2, "correct": 1, "n": 2},
        "zoology": {"accuracy": 2 / 3, "correct": 2, "n": 3},
    }
    assert report["macro"] == pytest.approx((1 / 2 + 2 / 3) / 2)


@pytest.mark.parametrize("few_shot", [0, 2])
@pytest.mark.parametrize("kind", ["word_level", "llama_style"])
def test_letter_scores_match_a_plain_forward_pass(kind, few_shot):
    """Unbiased random model; the LLaMA-style tokenizer prepends bos and splits "Answer:" into several pieces."""
    tokenizer = tokenizer_for_tests() if kind == "word_level" else build_llama_style_tokenizer()
    model = tiny_model(tokenizer, seed=1)
    report, predictions = score_multiple_choice(
        model, tokenizer, MMLU_ROWS, few_shot=few_shot, few_shot_dataset=FEW_SHOT_ROWS, instruction=MMLU_INSTRUCTION,
        batch_size=3, **QUIET,
    )  # fmt: skip
    pool = read_questions(FEW_SHOT_ROWS)
    for question, row in zip(read_questions(MMLU_ROWS), predictions, strict=True):
        prompt = build_prompt(question, select_shots(question, pool, few_shot), instruction=MMLU_INSTRUCTION)
        expected = plain_letter_scores(model, tokenizer, prompt)
        assert row["scores"] == pytest.approx(expected, abs=1e-5)
        assert row["prediction"] == "ABCD"[max(range(4), key=expected.__getitem__)]
    correct = sum(row["correct"] for row in predictions)
    assert report["all"] == {"accuracy": correct / 5, "correct": correct, "n": 5}


def test_both_layouts_give_the_same_result(tokenizer, model):
    mmlu, mmlu_predictions = score_multiple_choice(model, tokenizer, Dataset.from_list(MMLU_ROWS), **QUIET)
    ceval, ceval_predictions = score_multiple_choice(
        model, tokenizer, Dataset.from_list(ceval_rows(MMLU_ROWS)), **QUIET
    )
    renamed = [
        {"stem": r["question"], "options": r["choices"], "label": r["answer"], "topic": r["subject"]}
        for r in MMLU_ROWS
    ]
    custom, custom_predictions = score_multiple_choice(
        model, tokenizer, renamed, question_column="stem", choices_column="options", answer_column="label",
        subject_column="topic", **QUIET,
    )  # fmt: skip
    assert ceval["subjects"] == {"all": mmlu["all"]}  # no subject column: everything in "all"
    assert ceval["all"] == mmlu["all"]
    assert custom == mmlu
    for a, b, c in zip(mmlu_predictions, ceval_predictions, custom_predictions, strict=True):
        assert a["prediction"] == b["prediction"] == c["prediction"]
        assert a["scores"] == b["scores"] == c["scores"]
        assert b["subject"] == "all"
    # the C-Eval layout read back: letters → indices, choices in column order
    assert read_questions(ceval_rows(MMLU_ROWS))[3] == Question(
        "how is a dog today", ("bad", "sad", "very happy today", "good"), 2
    )


def test_few_shot_prompt_has_k_solved_examples_of_the_same_subject():
    pool = read_questions(FEW_SHOT_ROWS)
    question = read_questions(MMLU_ROWS)[2]  # astronomy
    shots = select_shots(question, pool, 2)
    assert [s.question for s in shots] == ["is the sun hot", "is the moon long"]
    assert build_prompt(question, shots, instruction=MMLU_INSTRUCTION) == (
        "The following are multiple choice questions (with answers) about astronomy.\n\n"
        "is the sun hot\nA. yes\nB. no\nC. so\nD. or\nAnswer: A\n\n"
        "is the moon long\nA. yes\nB. no\nC. so\nD. or\nAnswer: B\n\n"
        "why is the moon nice\nA. it is\nB. no\nC. so much more\nD. but\nAnswer:"
    )
    # cloze form for text scoring: no lettered choices, examples answered with the text
    assert build_prompt(question, shots[:1], scoring="text") == (
        "is the sun hot\nAnswer: yes\n\nwhy is the moon nice\nAnswer:"
    )
    assert len(select_shots(question, pool, 5)) == 3  # only three astronomy examples
    # no subjects on either side: the first k of the pool
    unsorted_pool = read_questions(ceval_rows(FEW_SHOT_ROWS))
    assert select_shots(question, unsorted_pool, 2) == unsorted_pool[:2]
    assert select_shots(read_questions(ceval_rows(MMLU_ROWS))[0], pool, 2) == pool[:2]
    assert select_shots(question, pool, 0) == []


def test_text_scoring_picks_the_highest_mean_loglikelihood(tokenizer, model):
    report, predictions = score_multiple_choice(
        model, tokenizer, MMLU_ROWS, scoring="text", few_shot=1, few_shot_dataset=FEW_SHOT_ROWS, **QUIET
    )
    pool = read_questions(FEW_SHOT_ROWS)
    for question, row in zip(read_questions(MMLU_ROWS), predictions, strict=True):
        context = build_prompt(question, select_shots(question, pool, 1), scoring="text")
        expected = [plain_mean_loglikelihood(model, tokenizer, context, choice) for choice in question.choices]
        assert row["scores"] == pytest.approx(expected, abs=1e-5)
        assert row["prediction"] == "ABCD"[max(range(4), key=expected.__getitem__)]
    assert report["all"]["correct"] == sum(row["correct"] for row in predictions)


@pytest.mark.parametrize("scoring", ["letter", "text"])
def test_scores_do_not_depend_on_batch_size_or_padding_side(scoring, model):
    settings = dict(scoring=scoring, few_shot=2, few_shot_dataset=FEW_SHOT_ROWS, **QUIET)
    results = []
    for batch_size, side in [(1, "left"), (4, "left"), (4, "right"), (64, "right")]:
        tokenizer = tokenizer_for_tests()
        tokenizer.padding_side = side
        results.append(score_multiple_choice(model, tokenizer, MMLU_ROWS, batch_size=batch_size, **settings))
    reference_report, reference = results[0]
    for report, predictions in results[1:]:
        assert report == reference_report
        for a, b in zip(reference, predictions, strict=True):
            assert a["scores"] == pytest.approx(b["scores"], abs=1e-5)


def test_long_prompts_lose_their_start(tokenizer, model, caplog):
    _, predictions = score_multiple_choice(
        model, tokenizer, MMLU_ROWS, few_shot=2, few_shot_dataset=FEW_SHOT_ROWS, max_length=12, **QUIET
    )
    assert "5 of 5 model inputs were longer than 12 tokens" in caplog.text  # one input per question: the letters
    pool = read_questions(FEW_SHOT_ROWS)
    for question, row in zip(read_questions(MMLU_ROWS), predictions, strict=True):
        ids = tokenizer(build_prompt(question, select_shots(question, pool, 2))).input_ids[-12:]
        with torch.no_grad():
            logprobs = model(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
        expected = [logprobs[tokenizer.convert_tokens_to_ids(letter)].item() for letter in "ABCD"]
        assert row["scores"] == pytest.approx(expected, abs=1e-5)


@pytest.mark.slow  # seconds (the README's command stays under 4 minutes; .ci/run runs it)
def test_compare_writes_report_predictions_and_table(tokenizer, tmp_path, capsys):
    paths = {}
    for name, letter in [("policy", "B"), ("baseline", "A")]:
        paths[name] = tmp_path / name
        always(tiny_model(tokenizer), tokenizer.convert_tokens_to_ids(letter)).save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    out = tmp_path / "eval"
    report = compare_multiple_choice(paths, Dataset.from_list(MMLU_ROWS), out, batch_size=2, **QUIET)

    assert json.loads((out / "mcq_report.json").read_text()) == report
    assert set(report) == {"task", "scoring", "few_shot", "models"}
    assert (report["task"], report["scoring"], report["few_shot"]) == ("mcq", "letter", 0)
    assert list(report["models"]) == ["policy", "baseline"]
    policy, baseline = report["models"]["policy"], report["models"]["baseline"]
    assert set(policy) == {"subjects", "all", "macro"}
    assert policy["all"] == {"accuracy": 0.6, "correct": 3, "n": 5}
    assert baseline["all"] == {"accuracy": 0.2, "correct": 1, "n": 5}
    assert baseline["subjects"] == {
        "astronomy": {"accuracy": 0.5, "correct": 1, "n": 2},
        "zoology": {"accuracy": 0.0, "correct": 0, "n": 3},
    }
    assert baseline["macro"] == pytest.approx(0.25)

    lines = [json.loads(line) for line in (out / "mcq_predictions.jsonl").read_text().splitlines()]
    assert [(r["model"], r["index"], r["prediction"]) for r in lines] == [
        *(("policy", i, "B") for i in range(5)),
        *(("baseline", i, "A") for i in range(5)),
    ]
    assert set(lines[0]) == {"model", "index", "subject", "question", "answer", "prediction", "correct", "scores"}
    assert sorted(p.name for p in out.iterdir()) == ["mcq_predictions.jsonl", "mcq_report.json"]  # no temp files

    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if line.startswith("subject"))
    assert header.split()[:4] == ["subject", "n", "policy", "baseline"] and "policy − baseline" in header
    zoology = next(line for line in table.splitlines() if line.startswith("zoology"))
    assert zoology.split() == ["zoology", "3", "66.7", "0.0", "+66.7"]
    micro = next(line for line in table.splitlines() if line.startswith("all (micro)"))
    assert micro.split()[2:] == ["5", "60.0", "20.0", "+40.0"]


def test_bad_layouts_and_answers_give_clear_errors(tokenizer, model):
    with pytest.raises(ValueError, match=r"Unrecognised multiple-choice layout: columns found \['question', 'opts'"):
        read_questions([{"question": "q", "opts": ["a", "b"], "answer": 0}])
    with pytest.raises(ValueError, match=r"Column\(s\) \['question'\] not in the dataset: columns found \['stem'"):
        read_questions([{"stem": "q", "choices": ["a", "b"], "answer": 0}])
    with pytest.raises(ValueError, match=r"Choice column\(s\) \['options'\] not in the dataset"):
        read_questions(MMLU_ROWS, choices_column="options")
    with pytest.raises(ValueError, match=r"Row 1: answer 4 is not one of its 4 choices .*0-3 or a letter A-D"):
        read_questions([MMLU_ROWS[0], {**MMLU_ROWS[1], "answer": 4}])
    with pytest.raises(ValueError, match=r"Row 0: answer 'E' is not one of its 4 choices"):
        read_questions([{**ceval_rows(MMLU_ROWS)[0], "answer": "E"}])
    for answer in (-1, True, "AB", 1.5, None):
        with pytest.raises(ValueError, match="is not one of its"):
            read_questions([{**MMLU_ROWS[0], "answer": answer}])
    with pytest.raises(ValueError, match="not a list of 2-26 options"):
        read_questions([{**MMLU_ROWS[0], "choices": "abcd"}])
    with pytest.raises(ValueError, match="Pass one split"):
        read_questions(DatasetDict({"test": Dataset.from_list(MMLU_ROWS)}))
    with pytest.raises(ValueError, match="no questions"):
        read_questions(MMLU_ROWS, max_questions=0)
    with pytest.raises(ValueError, match="few_shot_dataset"):
        score_multiple_choice(model, tokenizer, MMLU_ROWS, few_shot=2, **QUIET)
    with pytest.raises(ValueError, match="Unknown scoring 'bogus'"):
        score_multiple_choice(model, tokenizer, MMLU_ROWS, scoring="bogus", **QUIET)
    # lower-case letters and numpy-style integers are fine
    assert read_questions([{**ceval_rows(MMLU_ROWS)[0], "answer": " c "}])[0].answer == 2
    assert [q.answer for q in read_questions(Dataset.from_list(MMLU_ROWS), max_questions=3)] == [1, 1, 0]
