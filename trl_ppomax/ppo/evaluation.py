"""Evaluation and sample tables of :class:`~trl_ppomax.PPOMaxTrainer` (:class:`Evaluator`): the rollout phase run on
held-out prompts, reported with the same per-response metrics as training (``eval_…``)."""

from __future__ import annotations

from collections import defaultdict

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from tqdm.auto import tqdm
from trl.trainer.utils import print_prompt_completions_sample

from trl_ppomax.base import metrics as M
from trl_ppomax.data import rows_of_this_process
from trl_ppomax.ppo.rollouts import Rollouts
from trl_ppomax.reporting.plotting import log_table
from trl_ppomax.rewards import decode_texts


class Evaluator:
    """``evaluate()`` and the sample tables; it changes nothing but what it reports, returns and prints.

    Args:
        args: the run's :class:`~trl_ppomax.PPOMaxConfig` (``local_rollout_forward_batch_size``, ``eval_do_sample``,
            ``disable_tqdm``, the trackers of ``report_to``).
        accelerator: the run's ``Accelerator``; ``tokenizer``: the policy's (decodes the tables).
        rollouts: the rollout phase (:class:`~trl_ppomax.ppo.rollouts.Rollouts`), run on the evaluation prompts.
        experience_maker: its ``shape_scores`` and ``response_metrics`` give the per-response metrics.
        reduce_sum: a tensor summed over every process.
        datasets: ``() -> (train_dataset, eval_dataset)``, the trainer's prepared prompts (read at each call).
        prepare: prepares a dataset passed to :meth:`evaluate` as the training prompts were.
        report: called with each evaluated dataset's metrics (the trainer logs them and tells its callbacks).
        current_step: ``() -> int``, the trainer's ``state.global_step`` (a table's step); ``callbacks``: the
            trainer's live callback list (where TensorBoard writes).
    """

    def __init__(
        self,
        *,
        args,
        accelerator,
        tokenizer,
        rollouts: Rollouts,
        experience_maker,
        reduce_sum,
        datasets,
        prepare,
        report,
        current_step,
        callbacks,
    ) -> None:
        self.args, self.accelerator, self.tokenizer, self.rollouts = args, accelerator, tokenizer, rollouts
        self.experience_maker, self.reduce_sum = experience_maker, reduce_sum
        self.datasets, self.prepare, self.report = datasets, prepare, report
        self.current_step, self.callbacks = current_step, callbacks

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
        ``eval_<name>_<metric>``; a name (as the Trainer passes it) picks one of the trainer's datasets. Each
        dataset's metrics go to ``report``; returns them all."""
        own = self.datasets()[1]
        dataset = own if eval_dataset is None else eval_dataset
        if isinstance(dataset, dict):
            metrics = {}
            for name, part in dataset.items():  # the trainer's own datasets by name: they are prepared already
                part = name if eval_dataset is None else part
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        if isinstance(eval_dataset, str):
            if not isinstance(own, dict) or eval_dataset not in own:
                raise ValueError(f"evaluate({eval_dataset!r}) needs the trainer's eval_dataset to be a dict with it.")
            dataset = own[eval_dataset]
        elif eval_dataset is not None:
            dataset = self.prepare(eval_dataset)
        if not isinstance(dataset, Dataset):
            raise ValueError("evaluate() needs an eval_dataset of prompts, passed here or to the trainer.")
        with self._own_random_stream():
            totals = self._evaluation_sums(dataset)
        sums = dict(zip(totals, self.reduce_sum(torch.stack(list(totals.values()))), strict=True))
        count = sums.pop("count")
        metrics = {M.eval_name(name, metric_key_prefix): (value / count).item() for name, value in sums.items()}
        self.report(metrics)
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
            rollout = self.rollouts.rollout_rows(dataset, rows[start : start + chunk], self.args.eval_do_sample)
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
        train_dataset, eval_dataset = self.datasets()
        dataset = eval_dataset if isinstance(eval_dataset, Dataset) else train_dataset
        with self._own_random_stream():
            rows = list(range(min(num_prompts, len(dataset))))
            rollout = self.rollouts.rollout_rows(dataset, rows, sampling, scores_only=True)
        self._trajectory_tool_metrics()  # not training's
        return self.show_completions(rollout)

    def show_completions(self, rollout, limit: int | None = None) -> list[dict[str, object]]:
        """Print the first ``limit`` (None: all) rows of ``rollout`` as a table of query, response and score (and log
        it as ``completions`` to the trackers), gathered from every process; return the rows."""
        tokenizer, rollout = self.tokenizer, rollout.select(torch.arange(len(rollout.scores))[:limit])
        queries = decode_texts(tokenizer, rollout.query_ids, rollout.query_mask)
        responses = decode_texts(tokenizer, rollout.response_ids, rollout.response_mask)
        rows = zip(queries, responses, rollout.scores.tolist(), strict=True)
        rows = [{"query": q, "response": r, "score": s} for q, r, s in rows]
        rows = [row for part in gather_object([rows]) for row in part]
        if self.accelerator.is_main_process:
            scores = {"score": [row["score"] for row in rows]}
            queries, responses = [row["query"] for row in rows], [row["response"] for row in rows]
            step = self.current_step()
            print_prompt_completions_sample(queries, responses, scores, None, step)
            log_table(self.args, "completions", rows, step, self.callbacks)
        return rows

    def _trajectory_tool_metrics(self) -> dict[str, float]:
        """The agent loop's tool calls and turns per trajectory since its last rollout (popped, so they never reach
        training's log); empty without an agent."""
        agent = self.rollouts.agent
        measured = agent.pop_metrics() if agent is not None else {}
        return {name: measured[name] for name in (M.TOOL_CALL_FREQUENCY, M.TOOL_TURNS) if name in measured}

    def _own_random_stream(self):
        """torch's random state forked and restored: sampling here never changes what training samples next, so the
        trained weights do not depend on how often one evaluates or prints samples."""
        device = self.accelerator.device
        return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
