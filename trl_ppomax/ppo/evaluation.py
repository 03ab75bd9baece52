"""Evaluation and sample tables of :class:`~trl_ppomax.PPOMaxTrainer` (mixed into it): the rollout
phase run on held-out prompts, reported with the same per-response metrics as training (``eval_…``)."""

from __future__ import annotations

from collections import defaultdict

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from tqdm.auto import tqdm
from trl.trainer.utils import print_prompt_completions_sample

from trl_ppomax import data, models
from trl_ppomax.base import metrics as M
from trl_ppomax.base.rollout import Rollout
from trl_ppomax.data import rows_of_this_process
from trl_ppomax.ppo.setup import prepare_eval_prompts
from trl_ppomax.reporting.plotting import log_table
from trl_ppomax.rewards import decode_texts


class EvaluationMixin:
    """``evaluate()`` and ``generate_completions()`` of :class:`~trl_ppomax.PPOMaxTrainer` (mixed into it). Besides
    ``transformers.Trainer``'s attributes it uses the trainer's public hooks only: ``rollout``, ``generate_rollout``,
    ``rollout_context``, ``agent``, ``scorer``, ``experience_maker`` (``shape_scores``, ``response_metrics``) and
    ``reduce_sum``; it changes nothing but the log and the callbacks' control."""

    @torch.no_grad()
    def sample_and_score(self, query_ids, query_mask, sampling=True, columns=None) -> Rollout:
        """Responses to left-padded prompts and their scores, for sample tables: a :class:`Rollout` without the
        log-prob and value forwards of :meth:`rollout` (those fields are None)."""
        self.model.eval()
        with self.rollout_context():
            with models.policy_for_generation(self.model_wrapped, self.accelerator, self.args):
                out = self.generate_rollout(query_ids, query_mask, sampling, 1, columns or {})
            columns = {**(columns or {}), **out.columns}
            rollout = self.scorer.sample_scores(
                out.query_ids, out.query_mask, out.response_ids, out.response_mask, columns
            )
        self.model.train()
        return rollout

    def rollout_rows(self, dataset: Dataset, rows: list[int], sampling: bool, scores_only: bool = False) -> Rollout:
        """The rollout of ``rows`` of a prepared prompt ``dataset`` (evaluation, win-rate callbacks); with
        ``scores_only``, responses and scores alone (:meth:`sample_and_score`)."""
        batch = self.data_collator([dataset[i] for i in rows])
        batch, columns = data.split_batch(batch, self.accelerator.device)  # columns: for the reward functions
        run = self.sample_and_score if scores_only else self.rollout
        return run(batch["input_ids"], batch["attention_mask"], sampling=sampling, columns=columns)

    @torch.no_grad()
    def evaluate(
        self,
        eval_dataset: Dataset | dict[str, Dataset] | str | None = None,
        ignore_keys=None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Generate on every evaluation prompt (greedy, or sampled with ``eval_do_sample``) and report the means of the
        per-response metrics (``eval_…``); torch's random state is restored afterwards. A dataset passed here is
        prepared as the training prompts are; a dict of datasets (here or the trainer's) is evaluated one by one as
        ``eval_<name>_<metric>``; a name (as the Trainer passes it) picks one of the trainer's datasets."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(dataset, dict):
            metrics = {}
            for name, part in dataset.items():  # the trainer's own datasets by name: they are prepared already
                part = name if eval_dataset is None else part
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        if isinstance(eval_dataset, str):
            if not isinstance(self.eval_dataset, dict) or eval_dataset not in self.eval_dataset:
                raise ValueError(f"evaluate({eval_dataset!r}) needs the trainer's eval_dataset to be a dict with it.")
            dataset = self.eval_dataset[eval_dataset]
        elif eval_dataset is not None:
            dataset = prepare_eval_prompts(self, eval_dataset)
        if not isinstance(dataset, Dataset):
            raise ValueError("evaluate() needs an eval_dataset of prompts, passed here or to the trainer.")
        with self._own_random_stream():
            totals = self._evaluation_sums(dataset)
        sums = dict(zip(totals, self.reduce_sum(torch.stack(list(totals.values()))), strict=True))
        count = sums.pop("count")
        metrics = {M.eval_name(name, metric_key_prefix): (value / count).item() for name, value in sums.items()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _evaluation_sums(self, dataset: Dataset) -> dict[str, torch.Tensor]:
        """This process's weighted sums of every per-response metric over its rows of ``dataset``, and ``count``."""
        device, chunk = self.accelerator.device, self.args.local_rollout_forward_batch_size
        totals: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=device))
        rows, weights = rows_of_this_process(len(dataset), self.accelerator)
        quiet = self.args.disable_tqdm or not self.accelerator.is_local_main_process or len(rows) <= chunk
        bar = tqdm(total=len(rows), desc="Evaluating", unit="prompt", leave=False, disable=quiet)
        maker = self.experience_maker
        for start in range(0, len(rows), chunk):
            bar.update(len(rows[start : start + chunk]))
            rollout = self.rollout_rows(dataset, rows[start : start + chunk], self.args.eval_do_sample)
            weight = torch.tensor(weights[start : start + chunk], device=device)
            for name, values in maker.response_metrics(rollout, *maker.shape_scores(rollout)).items():
                totals[name] += (values.float() * weight).sum()
            for name, value in self._trajectory_tool_metrics().items():  # per-trajectory means of this chunk
                totals[name] += value * weight.sum()
            totals["count"] += weight.sum()
        bar.close()
        return totals

    @torch.no_grad()
    def generate_completions(self, sampling: bool = False, num_prompts: int = 8) -> list[dict[str, object]]:
        """Generate for a few evaluation (or training) prompts, print a table (and log it as ``completions`` to
        wandb/trackio, as text to TensorBoard, when ``report_to`` names them) and return the rows."""
        dataset = self.eval_dataset if isinstance(self.eval_dataset, Dataset) else self.train_dataset
        with self._own_random_stream():
            rows = list(range(min(num_prompts, len(dataset))))
            rollout = self.rollout_rows(dataset, rows, sampling, scores_only=True)
        self._trajectory_tool_metrics()  # not training's
        return self.show_completions(rollout)

    def show_completions(self, rollout, limit: int | None = None) -> list[dict[str, object]]:
        """Print the first ``limit`` (None: all) rows of ``rollout`` as a table of query, response and score (and log
        it as ``completions`` to the trackers), gathered from every process; return the rows."""
        tokenizer, rollout = self.processing_class, rollout.select(torch.arange(len(rollout.scores))[:limit])
        queries = decode_texts(tokenizer, rollout.query_ids, rollout.query_mask)
        responses = decode_texts(tokenizer, rollout.response_ids, rollout.response_mask)
        rows = zip(queries, responses, rollout.scores.tolist(), strict=True)
        rows = [{"query": q, "response": r, "score": s} for q, r, s in rows]
        rows = [row for part in gather_object([rows]) for row in part]
        if self.accelerator.is_main_process:
            scores = {"score": [row["score"] for row in rows]}
            queries, responses = [row["query"] for row in rows], [row["response"] for row in rows]
            print_prompt_completions_sample(queries, responses, scores, None, self.state.global_step)
            log_table(self.args, "completions", rows, self.state.global_step, self.callback_handler.callbacks)
        return rows

    def _trajectory_tool_metrics(self) -> dict[str, float]:
        """The agent loop's tool calls and turns per trajectory since its last rollout (popped, so they never reach
        training's log); empty without an agent."""
        measured = self.agent.pop_metrics() if self.agent is not None else {}
        return {name: measured[name] for name in (M.TOOL_CALL_FREQUENCY, M.TOOL_TURNS) if name in measured}

    def _own_random_stream(self):
        """torch's random state forked and restored: sampling here never changes what training samples next, so the
        trained weights do not depend on how often one evaluates or prints samples."""
        device = self.accelerator.device
        return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
