"""``trl-ppomax evaluate``: the policy against a baseline on held-out prompts (``--task pairwise``, judged by ``rm``,
``llm``, ``human`` and ``gold``), or both on multiple-choice questions (``--task mcq``, the alignment tax)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

JUDGES = ("rm", "llm", "human", "gold")

EPILOG = """examples:
  trl-ppomax evaluate --policy out/ppo --baseline sft/ --prompts helpful=Anthropic/hh-rlhf#helpful-base \\
      harmless=Anthropic/hh-rlhf#harmless-base --num-prompts 200 --judges rm llm --reward-model rm/ \\
      --judge-model gpt-4o --output eval/ppo-vs-sft
  trl-ppomax evaluate --policy out/ppo --baseline sft/ --prompts eval.jsonl --judges human --output eval/h
      (writes eval/h/human/human_sheet.csv; fill its 'preferred' column, then add --human-sheet FILLED.csv)
  trl-ppomax evaluate --task mcq --policy out/ppo --baseline sft/ --data ceval.jsonl --few-shot 5 --output eval/mcq

Running the same command again resumes: answers and verdicts already in --output are not generated or paid for twice.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", choices=["pairwise", "mcq"], default="pairwise", help="what to evaluate")
    parser.add_argument("--policy", required=True, help="the RLHF policy: a model folder or Hub id")
    parser.add_argument("--baseline", help="what it is compared with, e.g. the SFT model (folder or Hub id)")
    parser.add_argument("--output", required=True, metavar="DIR", help="where answers, verdicts and reports go")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt subset and of the sampling")
    parser.add_argument("--split", default="test", help="split of --prompts / --data (default: test)")
    pairwise = parser.add_argument_group("pairwise (--task pairwise)")
    pairwise.add_argument(
        "--prompts",
        nargs="+",
        metavar="[CATEGORY=]SOURCE",
        help="prompt sources: a Hub id (ID#DATA_DIR for a subset), folder or data file, the release's prompt files; "
        "CATEGORY= names the category of its prompts (else --category-column, else 'all')",
    )
    pairwise.add_argument("--category-column", help="column holding each prompt's category")
    pairwise.add_argument("--num-prompts", type=int, help="a fixed random subset of this many prompts per source")
    pairwise.add_argument(
        "--judges", "--judge", nargs="+", choices=JUDGES, default=[], help="judges to ask (combinable)"
    )
    pairwise.add_argument("--reward-model", help="rm: the reward model (folder or Hub id)")
    pairwise.add_argument("--tie-threshold", type=float, default=0.0, help="rm, gold: |score margin| ≤ this is a tie")
    pairwise.add_argument("--gold-function", help="gold: MODULE:FUNCTION (default: the toy world's gold reward)")
    pairwise.add_argument("--judge-model", help="llm: the judge's model name, e.g. gpt-4o")
    pairwise.add_argument("--base-url", default="https://api.openai.com/v1", help="llm: OpenAI-compatible endpoint")
    pairwise.add_argument("--api-key-env", default="OPENAI_API_KEY", help="llm: environment variable with the key")
    pairwise.add_argument("--judge-prompt", help="llm: a template file with {question}, {answer_a}, {answer_b}")
    pairwise.add_argument("--judge-concurrency", type=int, default=4, help="llm: requests in flight")
    pairwise.add_argument("--human-sheet", help="human: the filled sheet to import (default: export a blank one)")
    pairwise.add_argument("--allow-partial", action="store_true", help="human: count unfilled rows as invalid")
    sampling = parser.add_argument_group("sampling (the paper's §6.1 defaults)")
    sampling.add_argument("--max-new-tokens", type=int, default=512, help="longest answer, in tokens")
    sampling.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    sampling.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling's probability mass")
    sampling.add_argument("--repetition-penalty", type=float, default=1.1, help="on generated tokens only")
    sampling.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    sampling.add_argument("--batch-size", type=int, default=8, help="prompts (or questions) per forward pass")
    mcq = parser.add_argument_group("multiple choice (--task mcq)")
    mcq.add_argument("--data", help="questions: Hub id (ID#CONFIG), folder or data file, MMLU or C-Eval columns")
    mcq.add_argument("--few-shot", type=int, default=0, help="solved examples in each prompt")
    mcq.add_argument("--few-shot-split", default="dev", help="split of --data the solved examples come from")
    mcq.add_argument("--few-shot-data", help="solved examples from another source (needed when --data is a file)")
    mcq.add_argument("--scoring", choices=["letter", "text"], default="letter", help="what is scored")
    mcq.add_argument("--subject-column", default="subject", help="column holding each question's subject")
    mcq.add_argument("--max-questions", type=int, help="score only the first N questions")


def run(args: argparse.Namespace) -> int:
    """Evaluate as the flags say; a bad flag or input is one error line and exit status 2, nothing half-written."""
    try:
        check_settings(args)
        check_paths(args)
        return _run_mcq(args) if args.task == "mcq" else _run_pairwise(args)
    except (ValueError, OSError, KeyError, ImportError) as err:
        print(f"trl-ppomax evaluate: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2


def split_category(item: str) -> tuple[str, str, str]:
    """``"helpful=Anthropic/hh-rlhf#helpful-base"`` → ``("helpful", "=", "Anthropic/hh-rlhf#helpful-base")``."""
    return item.partition("=") if "=" in item.split("#")[0] else ("", "", item)


def check_settings(args: argparse.Namespace) -> None:
    """Numbers that cannot work fail here, naming the flag, before anything loads."""
    for flag in ("num_prompts", "max_questions", "batch_size", "max_new_tokens", "judge_concurrency"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if args.few_shot < 0:
        raise ValueError(f"--few-shot must be 0 or more, got {args.few_shot}")
    if args.greedy or args.task != "pairwise":
        return  # the sampling settings are not used
    if not args.temperature > 0:
        raise ValueError(
            f"--temperature must be > 0 for sampling, got {args.temperature}; for greedy decoding use --greedy"
        )
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not args.repetition_penalty > 0:
        raise ValueError(f"--repetition-penalty must be > 0 (1 is none), got {args.repetition_penalty}")


def check_paths(args: argparse.Namespace) -> None:
    """A local model folder or data file that does not exist fails here, before anything loads or the Hub is tried."""
    from trl_ppomax.data.sources import check_local_paths

    data = {f"--prompts {s}": s.partition("#")[0] for _, _, s in map(split_category, args.prompts or [])}
    data.update({"--data": args.data, "--few-shot-data": args.few_shot_data})
    models = {"--policy": args.policy, "--baseline": args.baseline, "--reward-model": args.reward_model}
    check_local_paths({**models, **data}, datasets=list(data))


def _run_pairwise(args: argparse.Namespace) -> int:
    from datasets import concatenate_datasets

    from trl_ppomax.judging.answers import GenerationSettings, load_prompts
    from trl_ppomax.judging.run import evaluate_policy

    if not args.baseline or not args.prompts or not args.judges:
        raise ValueError("--task pairwise needs --baseline, --prompts and --judges")
    parts = [
        load_prompts(source, args.split, args.category_column, category or None, args.num_prompts, args.seed)
        for category, _, source in map(split_category, args.prompts)
    ]
    names = (
        "max_new_tokens",
        "temperature",
        "top_p",
        "repetition_penalty",
        "batch_size",
        "seed",
    )  # fields named as flags
    generation = GenerationSettings(do_sample=not args.greedy, **{name: getattr(args, name) for name in names})
    prompts = concatenate_datasets(parts)
    evaluate_policy(args.policy, args.baseline, prompts, args.output, build_judges(args), generation)
    if "human" in args.judges and not args.human_sheet:
        export_human_sheet(args.output)
    return 0


def build_judges(args: argparse.Namespace) -> list:
    """The judges named by ``--judges`` (``human`` only when a filled ``--human-sheet`` is given)."""
    judges = []
    for name in args.judges:
        if name == "rm":
            if not args.reward_model:
                raise ValueError("--judges rm needs --reward-model")
            from trl_ppomax.judging.scored import RewardModelJudge

            judges.append(RewardModelJudge(args.reward_model, tie_threshold=args.tie_threshold))
        elif name == "gold":
            from trl_ppomax.judging.scored import FunctionJudge
            from trl_ppomax.toyworld import gold_rewards  # commands sit above the demo

            function = gold_rewards
            if args.gold_function:
                module, sep, attribute = args.gold_function.partition(":")
                if not sep:
                    raise ValueError(f"--gold-function takes MODULE:FUNCTION, got {args.gold_function!r}")
                function = getattr(importlib.import_module(module), attribute)
            judges.append(FunctionJudge(function, tie_threshold=args.tie_threshold))
        elif name == "llm":
            if not args.judge_model:
                raise ValueError("--judges llm needs --judge-model (and --base-url for a server other than OpenAI's)")
            from trl_ppomax.judging.llm import LLMJudge

            settings = {"base_url": args.base_url, "prompt": args.judge_prompt, "concurrency": args.judge_concurrency}
            judges.append(LLMJudge(args.judge_model, api_key=os.environ.get(args.api_key_env), **settings))
        elif name == "human" and args.human_sheet:
            from trl_ppomax.judging.human import HumanJudge

            key = Path(args.output) / "human" / "human_key.json"
            judges.append(HumanJudge(args.human_sheet, key, allow_partial=args.allow_partial))
    return judges


def export_human_sheet(output: str) -> None:
    """Write the blind A/B sheet for the pairs of ``output`` (its ``pairs.jsonl``) under ``output/human``."""
    from trl_ppomax.judging.base import Pair
    from trl_ppomax.judging.human import export_sheet

    lines = (Path(output) / "pairs.jsonl").read_text(encoding="utf-8").splitlines()
    pairs = [Pair(**{**row, "finished": tuple(row["finished"])}) for row in map(json.loads, lines)]
    sheet, key = export_sheet(pairs, Path(output) / "human")
    print(
        f"\nhuman: {sheet} written for annotators (the key, {key}, stays with you). Fill its 'preferred' column "
        "(1, 2 or tie) and run the same command with --human-sheet FILLED.csv to count the verdicts."
    )


def _run_mcq(args: argparse.Namespace) -> int:
    from trl_ppomax.judging.mcq import compare_multiple_choice

    if not args.data:
        raise ValueError("--task mcq needs --data (questions with question, choices/A-D and answer columns)")
    shots = None
    if args.few_shot:
        if args.few_shot_data is None and os.path.isfile(args.data):
            raise ValueError("--few-shot with a data file needs --few-shot-data (a file of solved examples)")
        shots = _load_questions(args.few_shot_data or args.data, args.few_shot_split)
    models = {"policy": args.policy, **({"baseline": args.baseline} if args.baseline else {})}
    options = {name: getattr(args, name) for name in ("few_shot", "scoring", "batch_size", "max_questions")}
    questions = _load_questions(args.data, args.split)
    compare_multiple_choice(
        models, questions, args.output, few_shot_dataset=shots, subject_column=args.subject_column, **options
    )
    return 0


def _load_questions(source: str, split: str):
    """A split of ``source``: a Hub id (``ID#CONFIG`` for a subject or config), a folder or a data file."""
    from trl_ppomax.data.sources import load_any_dataset

    name, _, config = source.partition("#")
    if config:
        from datasets import load_dataset

        return load_dataset(name, config, split=split)
    return load_any_dataset(name, split=split)
