"""Prompt and ptx datasets: preparation, padding, and a resumable shuffled batch order."""

from __future__ import annotations

import logging
import re
import reprlib
from collections.abc import Callable, Sequence
from functools import partial

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerBase
from trl import is_conversational
from trl.trainer.utils import pad

logger = logging.getLogger(__name__)


class PromptCollator:
    """Pads ``input_ids`` (left by default, for generation) with its attention mask, and a ``loss_mask`` (ptx on
    dialogues) with 0; other columns (``prompt``, ``solution``: reward functions' keywords) pass through as lists."""

    def __init__(self, pad_token_id: int, padding_side: str = "left") -> None:
        self.pad_token_id, self.padding_side = pad_token_id, padding_side

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        ids = [torch.as_tensor(e["input_ids"], dtype=torch.long) for e in examples]
        columns = {"input_ids": (ids, self.pad_token_id), "attention_mask": ([torch.ones_like(i) for i in ids], 0)}
        if "loss_mask" in examples[0]:
            columns["loss_mask"] = ([torch.as_tensor(e["loss_mask"], dtype=torch.long) for e in examples], 0)
        batch = {k: pad(v, padding_value=fill, padding_side=self.padding_side) for k, (v, fill) in columns.items()}
        return batch | {key: [e[key] for e in examples] for key in examples[0].keys() - batch.keys()}


def rows_of(columns: dict[str, list] | None, rows: Sequence[int]) -> dict[str, list]:
    """Rows ``rows`` of every column (a forward micro-batch's share)."""
    return {key: [values[i] for i in rows] for key, values in (columns or {}).items()}


def repeat_rows(columns: dict[str, list] | None, times: int) -> dict[str, list]:
    """Every row of every column repeated ``times`` times in place (``[a, a, b, b]``), as the prompts' samples are."""
    return {key: [v for v in values for _ in range(times)] for key, values in (columns or {}).items()}


def split_batch(batch: dict, device) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """``(tensors on device, other columns)`` of a collated prompt batch: the columns go to the reward functions."""
    tensors = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)}


class ShuffledBatches:
    """The ``i``-th batch of a reshuffled-every-epoch stream, a pure function of ``(seed, i)``: batch ``i`` is the
    ``i mod (n // global_batch)``-th slice of ``global_batch`` indices of epoch ``e = i // (n // global_batch)``'s
    ``randperm(n)`` seeded with ``seed + e``, each process taking its ``local_batch`` share. No global random state:
    a resumed run continues the exact data order from the saved batch counter."""

    def __init__(
        self, dataset: Dataset, local_batch: int, num_processes: int, process_index: int, seed: int, collate: Callable
    ) -> None:
        self.dataset, self.local_batch, self.seed, self.collate = dataset, local_batch, seed, collate
        self.global_batch, self.offset = local_batch * num_processes, process_index * local_batch
        self.batches_per_epoch = len(dataset) // self.global_batch
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"The dataset has {len(dataset)} rows, fewer than one batch over all processes ({self.global_batch}); "
                "add rows or lower the batch size."
            )
        self._epoch, self._order = -1, None

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        epoch, position = divmod(index, self.batches_per_epoch)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._order = epoch, torch.randperm(len(self.dataset), generator=generator)
        start = position * self.global_batch + self.offset
        return self.collate([self.dataset[i] for i in self._order[start : start + self.local_batch].tolist()])


def tokenize_prompt(
    prompt: str | list[dict],
    tokenizer: PreTrainedTokenizerBase,
    tools: list | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """The ids of one prompt as the model family was trained: a conversation's chat-template text (with the ``tools``'
    JSON schemas, if any, and ``template_kwargs``: TRL GRPO's ``chat_template_kwargs``, e.g. Qwen3's
    ``enable_thinking``) with only the template's special tokens (``add_special_tokens=False``, as TRL's SFT); plain
    text by the tokenizer's own rule (e.g. LLaMA's BOS in front, as the MOSS-RLHF release). Never two BOS: the text's
    own and the tokenizer's."""
    if is_conversational({"prompt": prompt}):
        text = tokenizer.apply_chat_template(
            prompt, tools=tools or None, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    bos = tokenizer.bos_token_id
    return ids[1:] if bos is not None and ids[:2] == [bos, bos] else ids


def drop_oldest_turns(messages: list[dict], fits: Callable[[list[dict]], bool]) -> list[dict] | None:
    """The most recent whole turns (system messages kept) that ``fits``, as the MOSS-RLHF release drops them
    (``ppo_datahelper.py``); None when even the last turn alone does not fit."""
    system, turns = _split_system(messages)
    return next((system + turns[i:] for i in range(len(turns)) if fits(system + turns[i:])), None)


def _split_system(messages: list[dict]) -> tuple[list[dict], list[dict]]:
    system = [m for m in messages if m.get("role") == "system"]
    return system, [m for m in messages if m.get("role") != "system"]


def prepare_prompt_dataset(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    num_proc: int | None = None,
    max_prompt_length: int | None = None,
    truncate: bool = True,
    name: str = "The prompt dataset",
    max_kept_length: int | None = None,
    template_kwargs: dict | None = None,
) -> Dataset:
    """Tokenized prompts (``input_ids``) from ``input_ids`` (trl 1.12; kept as they are) or ``prompt`` (text or
    conversation, :func:`tokenize_prompt`), as the MOSS-RLHF release (``ppo_datahelper.py``): a conversation with an
    empty turn (content None, empty or blank) is dropped; one over ``max_prompt_length`` drops its oldest whole turns
    (:func:`drop_oldest_turns`); a prompt still longer is never cut: with ``truncate`` it is kept whole up to
    ``max_kept_length`` tokens (default ``max_prompt_length``) and skipped beyond, else an error; warnings count both.
    Empty prompts and disagreeing ``prompt``/``input_ids`` columns are refused (``name`` says which dataset). Other
    columns are kept: reward functions get them as keywords, as TRL's GRPO does."""
    if len(dataset) == 0:
        raise ValueError(f"{name} is empty; pass a dataset with at least one rollout batch of prompts.")
    columns = dataset.column_names
    if "prompt" not in columns and "input_ids" not in columns:
        raise ValueError(
            f"A prompt dataset needs an 'input_ids' column (tokenized, trl 1.12 style) or a 'prompt' column (text or "
            f"conversation); {name} has {columns}."
        )
    _refuse_wrong_prompt_types(dataset, name)
    for column in [c for c in ("prompt", "input_ids") if c in columns]:
        _refuse_empty_prompts(dataset[column], column, name)
    if "prompt" in columns:
        _refuse_unknown_roles(dataset["prompt"], name)
    if "input_ids" not in columns:
        kept = _drop_empty_turns(dataset, num_proc, name)
        dataset = _tokenize_prompts(kept, tokenizer, num_proc, max_prompt_length, template_kwargs)
        _refuse_empty_prompts(dataset["input_ids"], "input_ids", name, tokenized=True)
    elif "prompt" in columns:
        _check_prompts_match_ids(dataset, tokenizer, num_proc, name, template_kwargs)
    if not max_prompt_length:
        return dataset
    return _limit_prompt_length(dataset, max_prompt_length, max_kept_length or max_prompt_length, truncate, name)


def _tokenize_prompts(
    dataset: Dataset, tokenizer, num_proc: int | None, max_prompt_length: int | None, template_kwargs: dict | None
) -> Dataset:
    """An ``input_ids`` column; conversations over ``max_prompt_length`` lose their oldest whole turns, down to the
    last turn alone (the release drops while too long and more than one turn remains)."""

    def fits(kept: list[dict]) -> bool:
        return len(tokenize_prompt(kept, tokenizer, template_kwargs=template_kwargs)) <= max_prompt_length

    def tokenize(example: dict) -> dict:
        prompt = example["prompt"]
        if max_prompt_length and is_conversational({"prompt": prompt}):
            system, turns = _split_system(prompt)
            prompt = drop_oldest_turns(prompt, fits) or system + turns[-1:]
        return {"input_ids": tokenize_prompt(prompt, tokenizer, template_kwargs=template_kwargs)}

    dropped = [c for c in ("attention_mask", "loss_mask") if c in dataset.column_names]
    return dataset.map(tokenize, remove_columns=dropped, num_proc=num_proc, desc="Tokenizing prompts")


def is_blank(content) -> bool:
    return content is None or (isinstance(content, str) and not content.strip())


#: The roles a prompt conversation may hold.
ROLES = ("system", "user", "assistant")


def _refuse_unknown_roles(prompts: list, name: str) -> None:
    """Refuse conversations with a message whose role is not one of :data:`ROLES` (e.g. "usr", "human")."""
    for row, prompt in enumerate(prompts):
        if isinstance(prompt, list):
            unknown = sorted({str(m.get("role")) for m in prompt if isinstance(m, dict)} - set(ROLES))
            if unknown:
                raise ValueError(
                    f"{name}: row {row} has a message with the role {unknown[0]!r}; a conversation's roles must be "
                    f"one of {ROLES} (chat templates read no other). Rename it, e.g. with dataset.map(...)."
                )


def _drop_empty_turns(dataset: Dataset, num_proc: int | None, name: str) -> Dataset:
    """``dataset`` without the conversations that have an empty turn (the release's ``all(sample)``) or no user turn,
    counted in a warning; raises when none is left."""

    def complete(example: dict) -> bool:  # a user turn, and no message whose content is None, empty or blank
        prompt = example["prompt"]
        if not isinstance(prompt, list):
            return True
        return any(m.get("role") == "user" for m in prompt) and not any(is_blank(m.get("content")) for m in prompt)

    kept = dataset.filter(complete, num_proc=num_proc, desc="Dropping empty turns")
    if len(kept) == len(dataset):
        return dataset
    message = (
        f"{name}: {len(dataset) - len(kept)} of {len(dataset)} conversations have an empty message (content missing, "
        "None, empty or blank) or no user turn"
    )
    if len(kept) == 0:
        raise ValueError(f"{message}: no prompt is left. Fill in or remove the empty turns.")
    logger.warning("%s; they were dropped, as the MOSS-RLHF release drops such samples.", message)
    return kept


#: What each prompt column must hold: (test of one value, what the message says it must be, a hint).
PROMPT_TYPES: dict[str, tuple[Callable[[object], bool], str, str]] = {
    "prompt": (
        lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(m, dict) for m in v)),
        "a text (str) or a conversation (a list of {'role': ..., 'content': ...} messages)",
        "If these are token ids, put them, one list per row, in an 'input_ids' column instead.",
    ),
    "input_ids": (
        lambda v: isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v),
        "a list of token ids (ints)",
        "Tokenize the prompts (or pass texts in a 'prompt' column and let the trainer tokenize them).",
    ),
}


def _column_type_fits(feature, column: str) -> bool:
    """Whether the Arrow type of ``column`` alone shows that every row has the right type (no pass over the rows)."""
    inner = getattr(feature, "feature", None)  # the item type of a list column
    if column == "prompt":
        return getattr(feature, "dtype", None) in ("string", "large_string") or isinstance(inner, dict)
    return str(getattr(inner, "dtype", "")).startswith(("int", "uint"))


def _refuse_wrong_prompt_types(dataset: Dataset, name: str) -> None:
    """Refuse a ``prompt`` column of neither texts nor conversations, or an ``input_ids`` column of no int lists,
    naming the column and the first such row."""
    for column, (fits, expected, hint) in PROMPT_TYPES.items():
        if column not in dataset.column_names or _column_type_fits(dataset.features[column], column):
            continue
        wrong = ((row, v) for row, v in enumerate(dataset[column]) if v is not None and not fits(v))
        row, value = next(wrong, (None, None))
        if row is not None:
            raise ValueError(
                f"{name}: row {row} of the {column!r} column holds {type(value).__name__} {reprlib.repr(value)}; "
                f"each row must be {expected}. {hint}"
            )


def _refuse_empty_prompts(prompts, column: str, name: str, tokenized: bool = False) -> None:
    """Refuse None, blank text, no ids or no messages (a conversation with an empty turn is dropped instead)."""
    empty = [i for i, prompt in enumerate(prompts) if is_blank(prompt) or len(prompt) == 0]
    if empty:
        what = "tokenize to no tokens" if tokenized else f"are empty in the {column!r} column"
        raise ValueError(
            f"{name}: {len(empty)} of {len(prompts)} prompts {what} (the first at row {empty[0]}); the policy needs "
            f"a prompt to respond to. Remove or fill them first, e.g. dataset.filter(...) on the {column!r} column."
        )


def _check_prompts_match_ids(
    dataset: Dataset, tokenizer: PreTrainedTokenizerBase, num_proc, name: str, template_kwargs: dict | None = None
) -> None:
    """Refuse ``prompt`` and ``input_ids`` columns whose ids are not the tokenized prompt (which one is meant?)."""

    def same(example: dict) -> dict:
        ids = tokenize_prompt(example["prompt"], tokenizer, template_kwargs=template_kwargs)
        return {"same": ids == list(example["input_ids"])}

    flags = dataset.map(same, remove_columns=dataset.column_names, num_proc=num_proc, desc="Comparing columns")
    differ = [i for i, ok in enumerate(flags["same"]) if not ok]
    if differ:
        raise ValueError(
            f"{name} has both a 'prompt' and an 'input_ids' column, and in {len(differ)} of {len(dataset)} rows (the "
            f"first: row {differ[0]}) the ids are not the tokenized prompt. The 'input_ids' column would be used as "
            "it is and the prompt ignored. Drop one: dataset.remove_columns('prompt') to train on the ids as they "
            "are, or dataset.remove_columns('input_ids') to have the prompts tokenized here."
        )


def _limit_prompt_length(dataset: Dataset, max_length: int, max_kept: int, truncate: bool, name: str) -> Dataset:
    """Prompts longer than ``max_length`` (after dropping turns) are never cut: kept whole up to ``max_kept`` tokens
    and skipped beyond (``truncate``), with a warning that counts both; or an error (not ``truncate``)."""
    if max_kept < max_length:
        raise ValueError(f"max_kept_length={max_kept} must be at least max_prompt_length={max_length}.")
    lengths = [len(ids) for ids in dataset["input_ids"]]
    too_long = [n for n in lengths if n > max_length]
    if not too_long:
        return dataset
    message = (
        f"{name}: {len(too_long)} of {len(lengths)} prompts are longer than {max_length} tokens (longest: "
        f"{max(too_long)}), conversations after dropping their oldest turns"
    )
    if not truncate:
        raise ValueError(
            f"{message}. Shorten them, raise max_prompt_length (the model's context minus response_length by "
            f"default), or set truncate_long_prompts=True to keep them whole up to {max_kept} tokens and skip longer "
            "ones (a prompt is never cut inside a turn)."
        )
    fitting = [i for i, n in enumerate(lengths) if n <= max_kept]
    if not fitting:
        raise ValueError(
            f"{message}, and all are longer than {max_kept} tokens, the longest prompt that leaves room for a full "
            "response: none is left. Shorten the prompts or lower response_length."
        )
    skipped = len(lengths) - len(fitting)
    kept = f"{len(too_long) - skipped} kept whole (at most {max_kept} tokens: a prompt is never cut inside a turn)"
    logger.warning("%s: %s, %d skipped (longer), as the MOSS-RLHF release does.", message, kept, skipped)
    return dataset.select(fitting) if skipped else dataset


def prepare_text_dataset(
    dataset: Dataset, tokenizer: PreTrainedTokenizerBase, num_proc: int | None, assistant_only: bool = True
) -> Dataset:
    """``input_ids`` for the ptx loss, from ``input_ids``, ``text`` or conversational ``messages`` (the chat
    template). For ``messages`` with ``assistant_only``, a ``loss_mask`` keeps the loss on the assistant turns, as the
    MOSS-RLHF release masks its pre-training dialogues (``ppo_datahelper.py``): needs ``{% generation %}`` markers."""
    columns = dataset.column_names
    if "input_ids" in columns:
        return dataset.select_columns([c for c in ("input_ids", "loss_mask") if c in columns])
    if "messages" in columns:
        if assistant_only and not re.search(r"\{%-?\s*generation\s*-?%\}", tokenizer.chat_template or ""):
            raise ValueError(
                "ptx_assistant_only=True needs a chat template with {% generation %} markers around the assistant "
                "turns (the MOSS-RLHF template has them; see transformers' return_assistant_tokens_mask). Use such a "
                "template, or set ptx_assistant_only=False to train the ptx loss on every token."
            )

        def tokenize(example: dict) -> dict:
            out = tokenizer.apply_chat_template(
                example["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=assistant_only
            )
            mask = out["assistant_masks"] if assistant_only else [1] * len(out["input_ids"])
            return {"input_ids": out["input_ids"], "loss_mask": mask}

        return dataset.map(tokenize, remove_columns=columns, num_proc=num_proc, desc="Tokenizing ptx dialogues")
    if "text" not in columns:
        raise ValueError(f"ptx_dataset needs an 'input_ids', 'text' or 'messages' column; it has {columns}.")
    return dataset.map(
        lambda e: {"input_ids": tokenizer(e["text"])["input_ids"]},
        remove_columns=columns,
        num_proc=num_proc,
        desc="Tokenizing ptx texts",
    )


def prompt_preparer(args, tokenizer: PreTrainedTokenizerBase, policy) -> Callable[[Dataset], Dataset]:
    """``prepare_prompt_dataset`` with the trainer's settings: the prompt budget (``max_prompt_length``, or the
    policy's context minus ``response_length``, :func:`check_prompt_budget`), the longest prompt kept whole
    (:func:`longest_prompt_length`) and the truncation rule."""
    context, longest = model_context(policy), longest_prompt_length(policy, args.response_length)
    if context is not None:
        check_prompt_budget(context, args.max_prompt_length, args.response_length)
    return partial(
        prepare_prompt_dataset,
        tokenizer=tokenizer,
        num_proc=args.dataset_num_proc,
        max_prompt_length=longest if args.max_prompt_length is None else args.max_prompt_length,
        truncate=args.truncate_long_prompts,
        max_kept_length=longest,
        template_kwargs=args.chat_template_kwargs,
    )


def model_context(model) -> int | None:
    """``config.max_position_embeddings`` (of the text config for a multimodal model), or None when unknown."""
    config = getattr(model, "config", None)
    context = getattr(config, "max_position_embeddings", None)
    if context is None and hasattr(config, "get_text_config"):
        context = getattr(config.get_text_config(), "max_position_embeddings", None)
    return context if isinstance(context, int) else None


def longest_prompt_length(model, response_length: int) -> int | None:
    """The longest prompt kept whole when even its last turn exceeds the budget: the context minus
    ``response_length`` (a full response must fit), or None when unknown. The release keeps such a prompt up to its
    whole context (2048) and samples 512 tokens past LLaMA's positions; here it is skipped."""
    context = model_context(model)
    return None if context is None else context - response_length


def check_prompt_budget(context: int, max_prompt_length: int | None, response_length: int) -> None:
    """Prompt and response share ``context``: ``response_length`` must leave a prompt token, and both must fit."""
    where = f"the policy's context of {context} tokens (config.max_position_embeddings)"
    if response_length >= context:
        raise ValueError(
            f"response_length={response_length} does not fit {where}: prompt and response share it, so "
            f"{context - response_length} tokens would be left for the prompt. Lower response_length to leave room "
            f"for your prompts (e.g. response_length={context // 4} leaves {context - context // 4} prompt tokens), "
            "or use a model with a longer context."
        )
    if max_prompt_length is not None and max_prompt_length + response_length > context:
        left, shorter = context - response_length, f", or lower response_length to {context - max_prompt_length}"
        shorter_responses = f"{shorter} or less" if max_prompt_length < context else ""
        raise ValueError(
            f"max_prompt_length={max_prompt_length} + response_length={response_length} = "
            f"{max_prompt_length + response_length} tokens exceed {where}. Lower max_prompt_length to {left} or less "
            f"(or leave it unset to use the {left} tokens response_length leaves){shorter_responses}."
        )


def check_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    """The tokenizer needs a pad token; a pad token equal to eos works here but is worth a warning."""
    if getattr(tokenizer, "pad_token_id", None) is None:
        raise ValueError(
            "The tokenizer has no pad token; add one, e.g. tokenizer.add_special_tokens({'pad_token': '[PAD]'}) and "
            "resize the models' embeddings, or set tokenizer.pad_token to an unused token."
        )
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        logger.warning(
            "The pad token is the eos token (%r): safe here (responses are cut after their first stop token), but "
            "models that find their last token by the pad id misread such sequences; a dedicated pad token is safer.",
            tokenizer.eos_token,
        )


def rows_of_this_process(num_rows: int, accelerator) -> tuple[list[int], list[float]]:
    """This process's share of ``range(num_rows)`` and a weight per row: 1, or 0 for the padding that gives every
    process the same number of rows (generation may be a collective, e.g. under ZeRO-3)."""
    rows = list(range(num_rows))
    with accelerator.split_between_processes(rows) as own:
        real = len(own)
    with accelerator.split_between_processes(rows, apply_padding=True) as padded:
        return list(padded), [1.0] * real + [0.0] * (len(padded) - real)


def batch_streams(
    train_dataset: Dataset, ptx_dataset: Dataset | None, tokenizer, args, accelerator, collate: Callable
) -> tuple[ShuffledBatches, ShuffledBatches | None]:
    """This process's resumable shuffled streams: rollout batches (``local_prompt_batch_size`` prompts, left-padded)
    and, with ``ptx_coef > 0``, ptx batches (``per_device_train_batch_size`` texts, right-padded)."""
    seed = args.data_seed if args.data_seed is not None else args.seed
    batches = partial(
        ShuffledBatches, num_processes=accelerator.num_processes, process_index=accelerator.process_index, seed=seed
    )
    prompts = batches(train_dataset, args.local_prompt_batch_size, collate=collate)
    if ptx_dataset is None or args.ptx_coef <= 0:
        return prompts, None
    ptx = prepare_text_dataset(ptx_dataset, tokenizer, args.dataset_num_proc, args.ptx_assistant_only)
    right_padded = PromptCollator(tokenizer.pad_token_id, padding_side="right")
    return prompts, batches(ptx, args.per_device_train_batch_size, collate=right_padded)
