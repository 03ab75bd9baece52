"""One sampled answer per held-out prompt from the policy and from the baseline, cached on disk as each batch
arrives: the paper's §6.1 sampling (top-p 0.9, temperature 0.8, repetition penalty 1.1 on generated tokens only)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch
from accelerate.utils import release_memory
from datasets import Dataset, load_dataset
from tqdm.auto import tqdm

from trl_ppomax.data import PromptCollator, model_context, prepare_prompt_dataset
from trl_ppomax.data.sources import to_prompt_dataset
from trl_ppomax.generation import generate_responses, generation_kwargs
from trl_ppomax.judging.base import ALL, JsonlCache, Pair, prompt_key
from trl_ppomax.moss.data import load_dataset_or_release


@dataclass(frozen=True)
class GenerationSettings:
    """How both sides answer (the paper's §6.1 defaults); ``seed`` fixes the samples batch by batch."""

    max_new_tokens: int = 512
    temperature: float = 0.8
    top_p: float = 0.9
    repetition_penalty: float = 1.1
    do_sample: bool = True
    batch_size: int = 8
    seed: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def load_prompts(
    source: str | Dataset,
    split: str = "test",
    category_column: str | None = None,
    category: str | None = None,
    num_prompts: int | None = None,
    seed: int = 0,
) -> Dataset:
    """A ``prompt`` and a ``category`` column from any prompt source the trainer accepts (Hub id, folder, data file,
    the release's prompt files, HH-RLHF; ``"<hub id>#<data dir>"`` picks a subset, e.g.
    ``Anthropic/hh-rlhf#harmless-base``). The category is ``category_column``'s value, else ``category``, else
    ``"all"``. ``num_prompts`` keeps a fixed random subset (by ``seed``)."""
    dataset = source
    if not isinstance(source, Dataset):
        name, _, data_dir = source.partition("#")
        dataset = (
            load_dataset(name, data_dir=data_dir, split=split)
            if data_dir
            else load_dataset_or_release(name, split=split)
        )
    if category_column is not None and category_column not in dataset.column_names:
        raise ValueError(f"--category-column {category_column!r} is not a column of {source}: {dataset.column_names}.")
    labels = [str(c) for c in dataset[category_column]] if category_column else [category or ALL] * len(dataset)
    prompts = to_prompt_dataset(dataset)
    if "prompt" not in prompts.column_names:
        raise ValueError(f"{source} has tokenized prompts only (input_ids); evaluation needs 'prompt' text.")
    prompts = Dataset.from_dict({"prompt": prompts.to_dict()["prompt"], "category": labels})
    if num_prompts is not None and num_prompts < len(prompts):
        prompts = prompts.shuffle(seed=seed).select(range(num_prompts))
    return prompts


def load_causal_lm(name: str | os.PathLike, device=None, dtype: torch.dtype | None = None):
    """``(model, tokenizer)`` from a folder or Hub id, in eval mode: bfloat16 on a GPU when there is one, else float32
    on CPU (``device`` / ``dtype`` override)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = AutoModelForCausalLM.from_pretrained(os.fspath(name), dtype=dtype)
    return model.to(device).eval(), AutoTokenizer.from_pretrained(os.fspath(name))


MAX_NEW_TOKENS = "max_new_tokens (--max-new-tokens)"  # how messages name the answer length: setting and flag


def prompt_budget(model, max_new_tokens: int) -> int | None:
    """The longest prompt that leaves room for ``max_new_tokens`` in the model's context (None when its config does
    not say); a ValueError naming ``--max-new-tokens`` when an answer that long leaves no room for a prompt."""
    context = model_context(model)
    if context is not None and max_new_tokens >= context:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} (--max-new-tokens) does not fit the model's context of {context} tokens "
            f"(config.max_position_embeddings): prompt and answer share it, so {context - max_new_tokens} tokens "
            f"would be left for the prompt. Lower --max-new-tokens (e.g. --max-new-tokens {context // 4} leaves "
            f"{context - context // 4} prompt tokens), or evaluate a model with a longer context."
        )
    return None if context is None else context - max_new_tokens


@torch.no_grad()
def generate_answers(
    model, tokenizer, prompts: list, keys: list[str], settings: GenerationSettings, cache: JsonlCache, side: str
) -> list[dict]:
    """``{"text", "finished"}`` per prompt (``finished``: it ended with the stop token), from ``cache`` or generated
    in fixed batches of ``settings.batch_size`` (a batch is generated whole if any of its prompts is missing, with
    the seed ``settings.seed + first row``, so a resumed run samples what an uninterrupted one would)."""
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    if pad_id is None:
        raise ValueError("The tokenizer has neither a pad nor an eos token; set tokenizer.pad_token.")
    limit = prompt_budget(model, settings.max_new_tokens)
    try:
        ids = prepare_prompt_dataset(
            Dataset.from_dict({"prompt": prompts}), tokenizer, max_prompt_length=limit, name="The evaluation prompts"
        )["input_ids"]
    except ValueError as err:  # the trainer's wording names its setting, response_length: name evaluate's instead
        raise ValueError(str(err).replace("response_length", MAX_NEW_TOKENS)) from None
    if len(ids) != len(prompts):  # the answers are matched to the prompts by position
        raise ValueError(
            f"{len(prompts) - len(ids)} of {len(prompts)} evaluation prompts were dropped (an empty turn, or longer "
            f"than the {limit} tokens that leave room for {MAX_NEW_TOKENS}; see the warning above). Every prompt "
            f"needs an answer: remove or shorten them in the prompt set, or lower {MAX_NEW_TOKENS}."
        )
    collate, width = PromptCollator(pad_id), settings.batch_size
    sampling = SimpleNamespace(response_length=settings.max_new_tokens, **settings.as_dict())
    starts = [s for s in range(0, len(prompts), width) if any(f"{side}|{k}" not in cache for k in keys[s : s + width])]
    for start in tqdm(starts, desc=f"Generating ({side})", unit="batch"):
        batch = collate([{"input_ids": row} for row in ids[start : start + width]])
        query = batch["input_ids"].to(model.device), batch["attention_mask"].to(model.device)
        kwargs = generation_kwargs(sampling, eos_id, pad_id, settings.do_sample, prompt_width=query[0].shape[1])
        torch.manual_seed(settings.seed + start)
        responses, mask = generate_responses(model, *query, kwargs)
        for offset, (row, row_mask) in enumerate(zip(responses, mask, strict=True)):
            tokens = row[row_mask.bool()].tolist()
            finished = bool(tokens) and tokens[-1] == eos_id
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            cache.put(f"{side}|{keys[start + offset]}", {"text": text, "finished": finished})
    return [cache.get(f"{side}|{key}") for key in keys]


def make_pairs(
    policy, baseline, prompts: Dataset, settings: GenerationSettings, cache: JsonlCache, loader=load_causal_lm
) -> list[Pair]:
    """Answer every prompt with the policy, then with the baseline (one model in memory at a time; each a path,
    Hub id or ``(model, tokenizer)``), and pair the answers."""
    rows = prompts.to_dict()
    keys = [prompt_key(i, p) for i, p in enumerate(rows["prompt"])]
    answers = {}
    for side, source in (("policy", policy), ("baseline", baseline)):
        if all(f"{side}|{key}" in cache for key in keys):
            answers[side] = [cache.get(f"{side}|{key}") for key in keys]
            continue
        model, tokenizer = source if isinstance(source, tuple) else loader(source)
        answers[side] = generate_answers(model, tokenizer, rows["prompt"], keys, settings, cache, side)
        del model
        release_memory()  # garbage-collect and empty the CUDA cache: one model in memory at a time
    return [
        Pair(key, prompt, mine["text"], theirs["text"], category, (mine["finished"], theirs["finished"]))
        for key, prompt, category, mine, theirs in zip(
            keys, rows["prompt"], rows["category"], answers["policy"], answers["baseline"], strict=True
        )
    ]
