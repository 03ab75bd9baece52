"""PPOMaxRewardTrainer: trl's RewardTrainer plus the imitation (LM) loss of PPO-max reward models (§3.1, eq. 2).

``L = −E[log σ(r(x, y_w) − r(x, y_l))] + β_rm · E[−log p_LM(y_w | x)]``

The model trained is a ``*ForSequenceClassification`` (``num_labels=1``) with the causal LM's head as ``lm_head``,
reading the score head's last hidden state; checkpoints leave it out, so TRL, ``PPOMaxTrainer`` and
``transformers.pipeline`` load them without custom code."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch
from datasets import Dataset
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedModel
from trl import RewardTrainer
from trl.data_utils import is_conversational

from trl_ppomax.base import compat, core
from trl_ppomax.models import score_head, score_position, without_zero3_init
from trl_ppomax.reporting.plotting import log_image
from trl_ppomax.reward_modeling.config import PPOMaxRewardConfig
from trl_ppomax.rewards.stats import fold_reward_stats, reward_statistics, store_reward_stats

HISTOGRAM_NAME = "reward_margin_histogram.png"


def with_lm_head(causal_lm: PreTrainedModel) -> PreTrainedModel:
    """A ``*ForSequenceClassification`` (one label) sharing ``causal_lm``'s body, with its LM head as ``lm_head``.
    No weights are copied; only the score head is new, ``N(0, initializer_range)`` as in transformers."""
    head = causal_lm.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(causal_lm).__name__} has no LM head to compute the imitation loss with.")
    config = copy.deepcopy(causal_lm.config)
    config.num_labels = 1
    config.architectures = None
    with torch.device("meta"), without_zero3_init():  # a shell: every parameter is replaced below
        reward_model = AutoModelForSequenceClassification.from_config(config)
    setattr(reward_model, reward_model.base_model_prefix, getattr(causal_lm, causal_lm.base_model_prefix))
    weight = head.weight
    width = getattr(weight, "ds_shape", weight.shape)[1]  # under ZeRO-3 the weight is a partitioned placeholder
    reward_model.score = nn.Linear(width, 1, bias=False, device=weight.device, dtype=weight.dtype)
    nn.init.normal_(reward_model.score.weight, std=getattr(config, "initializer_range", 0.02))
    reward_model.lm_head = head
    leftover = [name for name, p in reward_model.named_parameters() if p.is_meta]
    if leftover:
        raise ValueError(f"Could not build a reward model from {type(causal_lm).__name__}: {leftover[:3]} unset.")
    return reward_model


def _causal_lm_with_reward_head(model: str | PreTrainedModel, args: PPOMaxRewardConfig) -> PreTrainedModel:
    """The model to train when ``lm_loss_coef > 0``: from a causal-LM id/path or instance, with ``lm_head``."""
    if isinstance(model, str):
        kwargs = {"trust_remote_code": args.trust_remote_code, **(args.model_init_kwargs or {})}
        model = AutoModelForCausalLM.from_pretrained(model, **kwargs)
    if hasattr(model, "lm_head") and hasattr(model, "score"):
        return model  # already built by with_lm_head
    if getattr(model, "score", None) is not None or model.get_output_embeddings() is None:
        raise ValueError(
            f"lm_loss_coef = {args.lm_loss_coef} > 0 needs a model with a language-model head (start from the SFT "
            f"causal LM, e.g. a model id or AutoModelForCausalLM), but {type(model).__name__} has none. Pass the "
            "causal LM, or set lm_loss_coef=0 to train with the pairwise loss alone."
        )
    return with_lm_head(model)


class PPOMaxRewardTrainer(RewardTrainer):
    """Reward-model trainer of PPO-max: trl's ``RewardTrainer`` (all its inputs, formats, margin and centering
    options) with the imitation loss on the chosen response (``lm_loss_coef``), reward statistics stored in the saved
    config (``reward_mean``, ``reward_std``), optional folding of them into the head, and the margin histogram."""

    _tag_names = ("trl", "reward-trainer", "trl-ppomax", "ppo-max")

    def __init__(self, model: str | PreTrainedModel, args: PPOMaxRewardConfig | None = None, *pargs, **kwargs) -> None:
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = PPOMaxRewardConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1]}-Reward")
        if not isinstance(args, PPOMaxRewardConfig):
            raise TypeError(f"args must be a PPOMaxRewardConfig, got {type(args).__name__}.")
        if args.lm_loss_coef > 0:
            model = _causal_lm_with_reward_head(model, args)
        super().__init__(model, args, *pargs, **kwargs)
        self.data_collator = ChosenResponseCollator(self.data_collator)
        self.reward_stats: dict[str, float] | None = None
        self._eval_rewards: list[torch.Tensor] = []
        self.heads_checked = False

    # -- data ----------------------------------------------------------------------------------------------------
    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        columns = set(dataset.column_names or [])
        if not ({"chosen", "rejected"} <= columns or {"chosen_ids", "rejected_ids"} <= columns):
            raise ValueError(
                f"The {dataset_name} dataset needs 'chosen' and 'rejected' columns (any trl preference format, with "
                f"or without 'prompt'), or tokenized 'chosen_ids'/'rejected_ids'; it has {sorted(columns)}. For raw "
                "Anthropic HH-RLHF rows use trl_ppomax.data.hh_rlhf.convert_hh_rlhf first."
            )
        check_preference_rows(dataset, dataset_name)
        dataset = super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        if "response_start" in (dataset.column_names or []):
            return dataset
        kwargs = (
            {"desc": f"Locating chosen responses in {dataset_name} dataset"} if isinstance(dataset, Dataset) else {}
        )
        return dataset.map(_response_start, fn_kwargs={"processing_class": processing_class}, **kwargs)

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if "response_start" not in self._signature_columns:
            self._signature_columns = [*self._signature_columns, "response_start"]

    # -- loss ----------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """trl's pairwise loss (margin, centering) + ``lm_loss_coef`` · CE of the LM head on chosen responses."""
        mode = "train" if self.model.training else "eval"
        response_mask = inputs.pop("chosen_response_mask")
        if use_lm := self.args.lm_loss_coef > 0:
            inputs["output_hidden_states"] = True
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        chosen, rejected = torch.chunk(outputs.logits.squeeze(-1).detach(), chunks=2)
        metrics = {"chosen_reward": chosen.mean(), "rejected_reward": rejected.mean()}
        if use_lm:
            lm_loss, lm_stats = self._imitation_loss(outputs, inputs, response_mask)
            loss = loss + self.args.lm_loss_coef * lm_loss
            metrics.update({"lm_loss": lm_loss.detach(), "lm_token_accuracy": lm_stats["accuracy"]})
        for name, value in metrics.items():
            compat.trainer_metrics(self)[mode][name].append(self.accelerator.gather_for_metrics(value).mean().item())
        if mode == "eval":
            self._eval_rewards.append(self.accelerator.gather_for_metrics(torch.stack([chosen, rejected], dim=1)))
        return (loss, outputs) if return_outputs else loss

    def _imitation_loss(self, outputs, inputs, response_mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Next-token CE of the LM head on the chosen half of the batch, over response tokens only."""
        hidden, half = outputs.hidden_states[-1], response_mask.shape[0]
        unwrapped = self.accelerator.unwrap_model(self.model)
        if not self.heads_checked:
            self.check_last_hidden_state_feeds_score(unwrapped, hidden, inputs, outputs)
        return core.lm_loss(unwrapped.lm_head(hidden[:half]), inputs["input_ids"][:half], response_mask)

    def check_last_hidden_state_feeds_score(self, model, hidden, inputs, outputs) -> None:
        """Once, on the first batch: the score head on the last hidden state (which the LM head reads) at the
        position the model reads (:func:`~trl_ppomax.models.score_position`, as PPO) must give the model's scores."""
        with torch.no_grad():
            last = score_position(model, inputs["input_ids"], inputs.get("attention_mask"))
            scores = model.score(hidden[torch.arange(len(last), device=last.device), last]).squeeze(-1)
            if not torch.allclose(scores.float(), outputs.logits.squeeze(-1).float(), atol=1e-3, rtol=1e-3):
                raise RuntimeError(
                    f"{type(model).__name__}'s score head does not read the body's last hidden state (e.g. a pooler "
                    "sits between them), so the imitation loss would train a state the score never sees. Use a "
                    "transformers *ForSequenceClassification causal LM (a linear `score` on the last hidden state), "
                    "or set lm_loss_coef=0 to train with the pairwise loss alone."
                )
        self.heads_checked = True

    # -- evaluation and statistics -------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """trl's evaluation, plus the mean/std of every chosen and rejected reward and the margin histogram."""
        self._eval_rewards = []
        metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        if not self._eval_rewards:
            return metrics
        pairs = torch.cat(self._eval_rewards).float().cpu()
        self._eval_rewards = []
        self.reward_stats = reward_statistics(pairs)
        extra = {f"{metric_key_prefix}_{name}": value for name, value in self.reward_stats.items()}
        self.log(extra)
        metrics.update(extra)
        if self.args.reward_histogram and self.accelerator.is_main_process:
            path = os.path.join(self.args.output_dir, HISTOGRAM_NAME)
            save_margin_histogram(pairs[:, 0] - pairs[:, 1], path)
            log_image(self.args, "reward_margins", path, self.state.global_step, self.callback_handler.callbacks)
        return metrics

    def train(self, *args, **kwargs):
        """Train, then measure the reward statistics (on the evaluation set, else the training set), store them in
        the model config and, with ``fold_reward_stats``, fold them into the score head."""
        output = super().train(*args, **kwargs)
        dataset = self.eval_dataset if isinstance(self.eval_dataset, Dataset) else self.train_dataset
        self.evaluate(dataset, metric_key_prefix="eval" if dataset is self.eval_dataset else "train_set")
        model = self.accelerator.unwrap_model(self.model)
        if self.args.fold_reward_stats:
            head = score_head(model)
            if not isinstance(head, nn.Linear):
                raise ValueError(
                    f"{type(model).__name__} has no linear `score` head to fold the reward statistics into."
                )
            self.reward_stats = fold_reward_stats(head, self.reward_stats)
        store_reward_stats(model.config, self.reward_stats)
        return output

    # -- saving --------------------------------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        """Save without the training-only ``lm_head``: a plain sequence-classification checkpoint."""
        if state_dict is None:
            state_dict = self.accelerator.unwrap_model(self.model).state_dict()
        state_dict = {k: v for k, v in state_dict.items() if not k.startswith("lm_head.") and ".lm_head." not in k}
        super()._save(output_dir, state_dict=state_dict)

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None, **_):
        """The reward model's card, README.md in output_dir (:func:`trl_ppomax.reporting.hub.create_model_card`)."""
        from trl_ppomax.reporting.hub import create_model_card

        if not self.is_world_process_zero():
            return
        model, history = self.accelerator.unwrap_model(self.model), self.state.log_history
        card = create_model_card(
            model, self.args, self.hub_model_id, model_name, dataset_name, tags, self._tag_names, history, "reward"
        )
        card.save(os.path.join(self.args.output_dir, "README.md"))


class ChosenResponseCollator:
    """Wraps trl's preference collator: adds ``chosen_response_mask`` (B, L), 1 on the chosen response tokens: from
    each example's ``response_start`` (see :func:`_response_start`) to the end of ``chosen_ids`` (its eos included)."""

    def __init__(self, collator) -> None:
        self.collator = collator

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.collator([{k: v for k, v in e.items() if k != "response_start"} for e in examples])
        positions = torch.arange(batch["input_ids"].shape[1])
        starts = torch.tensor([e["response_start"] for e in examples])
        ends = torch.tensor([len(e["chosen_ids"]) for e in examples])
        batch["chosen_response_mask"] = ((positions >= starts[:, None]) & (positions < ends[:, None])).long()
        return batch


PAIR_COLUMNS = ("chosen", "rejected", "chosen_ids", "rejected_ids")


def check_preference_rows(dataset, dataset_name: str) -> None:
    """A ``ValueError`` naming the column and row of a missing (None) or empty chosen or rejected response, which
    would fail deep in tokenization or train on nothing. Checked on the Arrow columns; streamed datasets are not."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not isinstance(dataset, Dataset):
        return
    table = dataset.with_format("arrow")
    for column in (name for name in PAIR_COLUMNS if name in dataset.column_names):
        values = table[column]
        missing = values.is_null()
        if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
            missing = pc.or_kleene(missing, pc.equal(pc.utf8_length(values), 0))
        elif pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
            missing = pc.or_kleene(missing, pc.equal(pc.list_value_length(values), 0))
        row = pc.index(pc.fill_null(missing, True), True).as_py()
        if row >= 0:
            what = f"no {column!r} (None)" if values[row].as_py() is None else f"an empty {column!r}"
            chosen, rejected = ("chosen_ids", "rejected_ids") if column.endswith("_ids") else ("chosen", "rejected")
            raise ValueError(
                f"Row {row} of the {dataset_name} dataset has {what}: every preference pair needs a chosen and a "
                f"rejected response. Drop or fix such rows first, e.g. "
                f"dataset.filter(lambda row: bool(row[{chosen!r}]) and bool(row[{rejected!r}]))."
            )


def _response_start(example: dict, processing_class) -> dict[str, int]:
    """Where the chosen response starts in ``chosen_ids`` (at least the last chosen token is response): after the
    part of ``chosen_ids`` that is the prompt (``prompt_ids``, or ``prompt`` tokenized as trl's ``RewardTrainer``
    does); without a prompt, after the common prefix of ``chosen_ids`` and ``rejected_ids``, which counts shared
    leading response tokens as prompt (give a ``prompt`` column to avoid it)."""
    chosen = example["chosen_ids"]
    if example.get("prompt_ids") is not None:
        start = _common_prefix_length(example["prompt_ids"], chosen)
    elif example.get("prompt") is not None:
        start = _common_prefix_length(_prompt_ids(processing_class, example), chosen)
    else:
        start = _common_prefix_length(chosen, example["rejected_ids"])
    return {"response_start": max(min(start, len(chosen) - 1), 0)}


def _prompt_ids(processing_class, example: dict) -> list[int]:
    """The prompt tokenized as trl's ``RewardTrainer`` tokenizes ``prompt + chosen``."""
    prompt = example["prompt"]
    if is_conversational(example):
        tools = example.get("tools")
        tools = json.loads(tools) if isinstance(tools, str) else tools
        ids = processing_class.apply_chat_template(
            prompt,
            tokenize=True,
            return_dict=True,
            add_generation_prompt=True,
            tools=tools,
            **(example.get("chat_template_kwargs") or {}),
        )["input_ids"]
    else:
        ids = processing_class(text=prompt)["input_ids"]
    return ids[0] if ids and isinstance(ids[0], list) else ids  # processors return a batch of one


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    """Number of leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def save_margin_histogram(margins: torch.Tensor, path: str) -> None:
    """The paper's Fig. 2: histogram of ``r(chosen) − r(rejected)`` over the evaluation pairs, as a PNG, drawn on
    matplotlib's Agg canvas directly (pyplot's global state and the user's backend are left alone)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4), layout="tight")
    FigureCanvasAgg(figure)
    axis = figure.subplots()
    axis.hist(margins.numpy(), bins=min(50, max(10, len(margins) // 5)), color="tab:blue", alpha=0.8)
    axis.axvline(0.0, color="black", linewidth=1)
    accuracy = (margins > 0).float().mean().item()
    axis.set(xlabel="r(chosen) − r(rejected)", ylabel="pairs", title=f"Reward margins (accuracy {accuracy:.1%})")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, dpi=120)
