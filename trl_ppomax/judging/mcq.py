"""Alignment tax: multiple-choice accuracy per subject of two models (the SFT model and the PPO policy, as in Fig. 12
of "Secrets of RLHF in Large Language Models Part I: PPO" on C-Eval), scored by the log-likelihood of the answers
(``lighteval`` is the better tool for full benchmark suites with their official prompts and splits).

Data layouts (column names configurable; rows without a subject go to the subject "all"):

* MMLU: ``question``, ``choices`` (a list of strings), ``answer`` (an index, 0 = A), ``subject``;
* C-Eval: ``question``, ``A``, ``B``, ``C``, ``D`` (one column per choice), ``answer`` (a letter such as "B").

Prompt, with ``k`` solved examples from ``few_shot_dataset`` (of the question's subject when there are subjects)::

    <instruction, formatted with {subject}>

    <example question>
    A. <choice>
    B. <choice>
    Answer: B

    <question>
    A. <choice>
    B. <choice>
    Answer:

Scoring: ``"letter"`` (default) predicts the letter whose continuation (``" A"``, ``" B"``, ...) has the highest
log-probability. ``"text"`` uses the cloze form (no lettered choices in the prompt, examples answered with the choice
text) and predicts the choice whose text, as continuation ``" <text>"``, has the highest mean per-token
log-likelihood. Ties go to the first choice.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import logging
import operator
import os
import string
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

import torch
from accelerate.utils import release_memory
from tqdm.auto import tqdm

from trl_ppomax.data import PromptCollator
from trl_ppomax.data.files import write_json, write_text_atomically
from trl_ppomax.judging.answers import load_causal_lm
from trl_ppomax.judging.base import ALL

logger = logging.getLogger(__name__)

Scoring = Literal["letter", "text"]
SCORINGS: tuple[Scoring, ...] = ("letter", "text")
LETTERS = string.ascii_uppercase  # choice letters: A = index 0
ANSWER_LABEL = "Answer:"  # ends every question; the answer follows it after a space
#: MMLU's instruction header (Hendrycks et al.); ``{subject}`` is the subject with underscores as spaces.
MMLU_INSTRUCTION = "The following are multiple choice questions (with answers) about {subject}."
METRIC_PATH = Path(__file__).parent / "metrics" / "mcq_accuracy"  # the local evaluate metric (correct / n)
REPORT_FILE = "mcq_report.json"
PREDICTIONS_FILE = "mcq_predictions.jsonl"


@dataclass(frozen=True)
class Question:
    """One multiple-choice question; ``answer`` is the index of the correct choice (0 = A)."""

    question: str
    choices: tuple[str, ...]
    answer: int
    subject: str = ALL


def _choice_source(columns: list[str], choices_column: str | Sequence[str] | None) -> str | list[str]:
    """The list column holding the choices (MMLU), or one column per choice (C-Eval's A, B, C, D)."""
    if choices_column is None:
        if "choices" in columns:
            return "choices"
        letters = list(itertools.takewhile(lambda c: c in columns, LETTERS))
        if len(letters) >= 2:
            return letters
        raise ValueError(
            f"Unrecognised multiple-choice layout: columns found {columns}. Expected MMLU (question, choices, answer "
            "= index) or C-Eval (question, A, B, C, D, answer = letter), or name the choices with choices_column=."
        )
    wanted = [choices_column] if isinstance(choices_column, str) else list(choices_column)
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise ValueError(f"Choice column(s) {missing} not in the dataset: columns found {columns}.")
    return choices_column if isinstance(choices_column, str) else wanted


def _answer_index(value, n_choices: int, row: int) -> int:
    """An index (int) or a letter ("B", any case) → the index, checked against the number of choices."""
    index = -1
    if isinstance(value, str):
        index = LETTERS.find(value.strip().upper()) if len(value.strip()) == 1 else -1
    elif not isinstance(value, bool):
        with contextlib.suppress(TypeError):
            index = operator.index(value)
    if not 0 <= index < n_choices:
        raise ValueError(
            f"Row {row}: answer {value!r} is not one of its {n_choices} choices (expected an index 0-{n_choices - 1} "
            f"or a letter A-{LETTERS[n_choices - 1]})."
        )
    return index


def read_questions(
    dataset,
    *,
    question_column: str = "question",
    choices_column: str | Sequence[str] | None = None,
    answer_column: str = "answer",
    subject_column: str | None = "subject",
    max_questions: int | None = None,
) -> list[Question]:
    """The first ``max_questions`` rows (all by default) of a ``datasets.Dataset`` or list of dicts as questions, in
    the layouts of the module docstring. ``choices_column``: a list column, a list of one column per choice, or
    ``None`` to detect MMLU's ``choices`` or C-Eval's ``A``, ``B``, ... A ``ValueError`` names the columns found or the
    row when the layout is not recognised, a column is missing or an answer is out of range."""
    if isinstance(dataset, Mapping):
        raise ValueError(f"Pass one split (e.g. dataset['test']), not a dict of splits: found keys {list(dataset)}.")
    columns = getattr(dataset, "column_names", None)  # a list of dicts has none: its first row's keys
    columns = list(columns if columns is not None else dataset[0] if len(dataset) else [])
    missing = [c for c in (question_column, answer_column) if c not in columns]
    if missing:
        raise ValueError(f"Column(s) {missing} not in the dataset: columns found {columns}.")
    source = _choice_source(columns, choices_column)
    has_subject = subject_column in columns  # None is no column name
    rows = dataset if max_questions is None else itertools.islice(dataset, max_questions)
    questions = []
    for i, row in enumerate(rows):
        raw = row[source] if isinstance(source, str) else [row[c] for c in source]
        if isinstance(raw, str) or not 2 <= len(raw) <= len(LETTERS):
            raise ValueError(f"Row {i}: choices {raw!r} are not a list of 2-{len(LETTERS)} options.")
        choices = tuple(str(c) for c in raw)
        answer = _answer_index(row[answer_column], len(choices), i)
        subject = str(row[subject_column]) if has_subject and row[subject_column] not in (None, "") else ALL
        questions.append(Question(str(row[question_column]), choices, answer, subject))
    if not questions:
        raise ValueError("The dataset has no questions.")
    return questions


def continuation(question: Question, index: int, scoring: Scoring = "letter") -> str:
    """What follows ``Answer:`` for choice ``index``: ``" B"`` (letter) or ``" <choice text>"`` (text)."""
    return " " + (LETTERS[index] if scoring == "letter" else question.choices[index])


def format_question(question: Question, *, scoring: Scoring = "letter", solved: bool = False) -> str:
    """The question, its ``A. <choice>`` lines (letter scoring only), and ``Answer:`` (followed by the correct
    :func:`continuation` when ``solved``)."""
    lines = [question.question]
    if scoring == "letter":
        lines += [f"{LETTERS[i]}. {choice}" for i, choice in enumerate(question.choices)]
    lines.append(ANSWER_LABEL + (continuation(question, question.answer, scoring) if solved else ""))
    return "\n".join(lines)


def select_shots(question: Question, pool: Sequence[Question], k: int) -> list[Question]:
    """The first ``k`` examples of ``pool`` with the question's subject; the first ``k`` of all of ``pool`` when the
    question or the pool has no subjects."""
    if k <= 0:
        return []
    if question.subject != ALL and any(s.subject != ALL for s in pool):
        pool = [s for s in pool if s.subject == question.subject]
    return list(pool[:k])


def build_prompt(
    question: Question, shots: Sequence[Question] = (), *, instruction: str | None = None, scoring: Scoring = "letter"
) -> str:
    """``instruction`` (``{subject}`` filled in, underscores as spaces), the solved ``shots`` and the question, as
    blocks separated by a blank line; ends with ``Answer:``."""
    blocks = [instruction.format(subject=question.subject.replace("_", " "))] if instruction else []
    blocks += [format_question(shot, scoring=scoring, solved=True) for shot in shots]
    blocks.append(format_question(question, scoring=scoring))
    return "\n\n".join(blocks)


@torch.no_grad()
def loglikelihoods(
    model,
    tokenizer,
    requests: Sequence[Sequence[tuple[str, str]]],
    *,
    batch_size: int = 8,
    max_length: int | None = None,
    progress: bool = True,
) -> list[list[tuple[float, int]]]:
    """``(Σ log p(continuation token | everything before it), number of continuation tokens)`` for every
    ``(context, continuation)`` of every question in ``requests`` (same nesting).

    The continuation's tokens are those of ``encode(context + continuation)`` after its longest common prefix with
    ``encode(context)``, so a letter of several tokens, or a tokenizer merging across the boundary, is handled. The
    model reads ``(context + continuation)[:-1]``, left-truncated to ``max_length`` (default: the model's
    ``max_position_embeddings``); requests with the same input (one context, single-token letters) share a forward
    pass. Inputs are batched ``batch_size`` at a time, longest first, right-padded with an explicit attention mask
    and positions: the scores do not depend on the batch size or the tokenizer's padding side."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    flat = [pair for question in requests for pair in question]
    owners = [q for q, question in enumerate(requests) for _ in question]
    max_length = max_length or getattr(getattr(model, "config", None), "max_position_embeddings", None)
    inputs, targets = _plan_inputs(tokenizer, flat, max_length)
    by_input = defaultdict(list)  # input index → the requests reading it
    for r, (i, _) in enumerate(targets):
        by_input[i].append(r)
    pending = Counter(q for rs in by_input.values() for q in {owners[r] for r in rs})  # inputs left per question

    pad_id = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    collate, device = PromptCollator(pad_id, padding_side="right"), next(model.parameters()).device
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]), reverse=True)
    scores: list[tuple[float, int]] = [(0.0, 0)] * len(flat)
    with tqdm(total=len(requests), desc="Scoring questions", unit="question", disable=not progress) as bar:
        for first in range(0, len(order), batch_size):
            batch = order[first : first + batch_size]
            padded = collate([{"input_ids": inputs[i]} for i in batch])
            padded["position_ids"] = (padded["attention_mask"].cumsum(-1) - 1).clamp(min=0)
            logits = model(**{k: v.to(device) for k, v in padded.items()}, use_cache=False).logits
            for row, i in enumerate(batch):
                for r in by_input[i]:  # the continuation's tokens are the last ones the input predicts
                    tokens = torch.tensor(targets[r][1], device=logits.device)
                    logprobs = logits[row, len(inputs[i]) - len(tokens) : len(inputs[i])].float().log_softmax(-1)
                    scores[r] = (logprobs.gather(-1, tokens[:, None]).sum().item(), len(tokens))
                for q in {owners[r] for r in by_input[i]}:
                    pending[q] -= 1
                    bar.update(int(pending[q] == 0))
    offsets = list(itertools.accumulate((len(question) for question in requests), initial=0))
    return [scores[start:end] for start, end in itertools.pairwise(offsets)]


def _plan_inputs(
    tokenizer, flat: Sequence[tuple[str, str]], max_length: int | None
) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
    """The distinct model inputs, and per ``(context, continuation)`` request ``(input index, continuation ids)``
    (see :func:`loglikelihoods`). Texts are encoded with the tokenizer's leading special token (LLaMA's bos), if it
    adds one, but no trailing ones (an eos would end up inside the continuation)."""
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("a")["input_ids"][:1] == [bos]
    prefix = [bos] if adds_bos and tokenizer("a", add_special_tokens=False)["input_ids"][:1] != [bos] else []

    def encode(texts: list[str]) -> list[list[int]]:
        return [prefix + list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]

    contexts = encode([context for context, _ in flat])
    fulls = encode([context + cont for context, cont in flat])
    index: dict[tuple[int, ...], int] = {}
    targets, truncated = [], set()
    for (context, cont), context_ids, full_ids in zip(flat, contexts, fulls, strict=True):
        n = min(len(context_ids), len(full_ids))
        start = next((i for i in range(n) if context_ids[i] != full_ids[i]), n)  # their common prefix
        if start == 0 or start == len(full_ids):
            raise ValueError(
                f"Cannot score continuation {cont!r} after context ...{context[-80:]!r}: it adds no tokens "
                "or the context has none."
            )
        model_input = full_ids[:-1]
        if max_length and len(model_input) > max_length:
            if len(full_ids) - start > max_length:
                raise ValueError(f"Continuation {cont!r} is longer than max_length={max_length} tokens.")
            model_input = model_input[-max_length:]
            truncated.add(tuple(model_input))
        targets.append((index.setdefault(tuple(model_input), len(index)), full_ids[start:]))
    if truncated:
        message = "%d of %d model inputs were longer than %d tokens: their start was cut off."
        logger.warning(message, len(truncated), len(index), max_length)
    return [list(ids) for ids in index], targets


@cache
def accuracy_metric():
    """The local ``mcq_accuracy`` metric (``evaluate.load`` of :data:`METRIC_PATH`, in memory; works offline)."""
    import evaluate

    return evaluate.load(str(METRIC_PATH), keep_in_memory=True)


def accuracy_report(predictions: Sequence[int], references: Sequence[int], subjects: Sequence[str]) -> dict:
    """``{"subjects": {subject: {"accuracy", "correct", "n"}}, "all": {...}, "macro": float}``: accuracy per subject
    (sorted by name), over all questions (micro average), and the unweighted mean over subjects (macro)."""
    metric = accuracy_metric()
    grouped = defaultdict(lambda: ([], []))
    for prediction, reference, subject in zip(predictions, references, subjects, strict=True):
        grouped[subject][0].append(prediction)
        grouped[subject][1].append(reference)
    per_subject = {s: metric.compute(predictions=p, references=r) for s, (p, r) in sorted(grouped.items())}
    return {
        "subjects": per_subject,
        "all": metric.compute(predictions=list(predictions), references=list(references)),
        "macro": sum(v["accuracy"] for v in per_subject.values()) / len(per_subject),
    }


def _score_questions(
    model, tokenizer, questions, pool, *, few_shot, scoring, instruction, **options
) -> tuple[dict, list]:
    """:func:`score_multiple_choice` on read questions; ``options`` are :func:`loglikelihoods`' keywords."""
    shots = [select_shots(q, pool, few_shot) for q in questions]
    short = sorted({q.subject for q, s in zip(questions, shots, strict=True) if len(s) < few_shot})
    if short:
        logger.warning("Fewer than %d few-shot examples for subject(s) %s: using those there are.", few_shot, short)
    requests = []  # per question, (prompt, continuation) for each choice
    for q, s in zip(questions, shots, strict=True):
        prompt = build_prompt(q, s, instruction=instruction, scoring=scoring)
        requests.append([(prompt, continuation(q, i, scoring)) for i in range(len(q.choices))])
    was_training = model.training
    model.eval()
    try:
        results = loglikelihoods(model, tokenizer, requests, **options)
    finally:
        model.train(was_training)
    scores = [[total / n if scoring == "text" else total for total, n in result] for result in results]
    predicted = [max(range(len(s)), key=s.__getitem__) for s in scores]
    report = accuracy_report(predicted, [q.answer for q in questions], [q.subject for q in questions])
    keys = ("index", "subject", "question", "answer", "prediction", "correct", "scores")
    return report, [
        dict(zip(keys, (i, q.subject, q.question, LETTERS[q.answer], LETTERS[p], p == q.answer, s), strict=True))
        for i, (q, p, s) in enumerate(zip(questions, predicted, scores, strict=True))
    ]


def score_multiple_choice(
    model,
    tokenizer,
    dataset,
    *,
    few_shot: int = 0,
    few_shot_dataset=None,
    scoring: Scoring = "letter",
    batch_size: int = 8,
    max_questions: int | None = None,
    instruction: str | None = None,
    question_column: str = "question",
    choices_column: str | Sequence[str] | None = None,
    answer_column: str = "answer",
    subject_column: str | None = "subject",
    max_length: int | None = None,
    progress: bool = True,
) -> tuple[dict, list[dict]]:
    """Score a loaded model on the questions of ``dataset`` (see the module docstring for layouts, prompt and
    scoring); the model is put in eval mode for the call and on its own device. Returns ``(report, predictions)``:
    ``report`` as :func:`accuracy_report`, and per question ``{"index", "subject", "question", "answer", "prediction",
    "correct", "scores"}`` (answer and prediction as letters; one score per choice: the log-probability of the letter,
    or the mean per-token log-likelihood of the text)."""
    options = {name: value for name, value in locals().items() if name not in ("model", "tokenizer", "dataset")}
    questions, pool, settings = _prepared(dataset, **options)
    return _score_questions(model, tokenizer, questions, pool, **settings)


def _prepared(
    dataset, *, few_shot, few_shot_dataset, scoring, max_questions, **settings
) -> tuple[list[Question], list[Question], dict]:
    """The questions (checked before any model loads), the few-shot pool, and the keywords of ``_score_questions``."""
    if scoring not in SCORINGS:
        raise ValueError(f"Unknown scoring {scoring!r}: use one of {', '.join(SCORINGS)}.")
    names = ("question_column", "choices_column", "answer_column", "subject_column")
    columns = {name: settings.pop(name) for name in names}
    questions = read_questions(dataset, max_questions=max_questions, **columns)
    if few_shot < 0:
        raise ValueError(f"few_shot must be >= 0, got {few_shot}.")
    if few_shot and few_shot_dataset is None:
        raise ValueError("few_shot > 0 needs a few_shot_dataset (e.g. the dev split), distinct from the questions.")
    pool = read_questions(few_shot_dataset, **columns) if few_shot else []
    return questions, pool, dict(few_shot=few_shot, scoring=scoring, **settings)


def format_table(report: dict) -> str:
    """Subjects (then "all" = micro and "macro") × model accuracies in %, with ``policy − baseline`` in points when
    both are there."""
    models = report["models"]
    names = list(models)
    diff = "policy" in models and "baseline" in models
    subjects = sorted(set().union(*(m["subjects"] for m in models.values())))
    rows = []
    for subject in subjects if subjects != [ALL] else []:
        cells = [models[m]["subjects"].get(subject) for m in names]
        rows.append((subject, str(next(c["n"] for c in cells if c)), [c["accuracy"] if c else None for c in cells]))
    rows.append(("all (micro)", str(models[names[0]]["all"]["n"]), [models[m]["all"]["accuracy"] for m in names]))
    rows.append(("macro", "", [models[m]["macro"] for m in names]))
    header = ["subject", "n", *names] + (["policy − baseline"] if diff else [])
    lines = []
    for subject, n, accuracies in rows:
        cells = [subject, n, *("-" if a is None else f"{100 * a:.1f}" for a in accuracies)]
        if diff:
            p, b = accuracies[names.index("policy")], accuracies[names.index("baseline")]
            cells.append("-" if p is None or b is None else f"{100 * (p - b):+.1f}")
        lines.append(cells)
    widths = [max(len(row[c]) for row in [header, *lines]) for c in range(len(header))]

    def fmt(row):
        return "  ".join([row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))])

    title = f"Multiple-choice accuracy (%), {report['scoring']} scoring, {report['few_shot']}-shot"
    return "\n".join([title, fmt(header), fmt(["-" * w for w in widths]), *map(fmt, lines)])


def compare_multiple_choice(
    models: Mapping[str, str | os.PathLike],
    dataset,
    output_dir: str | os.PathLike,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    **options,
) -> dict:
    """Score each model of ``models`` (name → folder or Hub name, e.g. ``{"policy": ..., "baseline": ...}``) on the
    same questions, one model in memory at a time, and print the table of :func:`format_table`. ``options`` are
    :func:`score_multiple_choice`'s keywords (scoring, few-shot, columns, batch size, …).

    Writes (atomically) and returns ``output_dir/mcq_report.json``, ``{"task": "mcq", "scoring", "few_shot",
    "models": {name: report}}`` with each report as :func:`accuracy_report`; writes ``mcq_predictions.jsonl`` beside
    it: the rows of :func:`score_multiple_choice` of every model, with ``"model"`` added."""
    if not models:
        raise ValueError("No models to compare.")
    parameters = inspect.signature(score_multiple_choice).parameters.values()
    defaults = {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY}
    unknown = sorted(options.keys() - defaults.keys())
    if unknown:
        raise TypeError(f"compare_multiple_choice() got unknown options {unknown}; it takes {sorted(defaults)}.")
    questions, pool, settings = _prepared(dataset, **{**defaults, **options})  # checked before a model loads
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)

    reports, predictions = {}, []
    for name, path in models.items():
        model, tokenizer = load_causal_lm(path, device, dtype)
        reports[name], rows = _score_questions(model, tokenizer, questions, pool, **settings)
        predictions += [{"model": name, **row} for row in rows]
        del model
        release_memory()  # garbage-collect and empty the CUDA cache: one model in memory at a time

    report = {"task": "mcq", "scoring": settings["scoring"], "few_shot": settings["few_shot"], "models": reports}
    write_json(out / REPORT_FILE, report)
    lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in predictions)
    write_text_atomically(out / PREDICTIONS_FILE, lines)
    print(format_table(report))
    return report
