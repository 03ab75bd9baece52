"""The paper's Fig. 4 red line during training: every ``every`` iterations, the policy's answers to a fixed set of
prompts against the SFT model's, judged by the trainer's own reward model (``rm``) or a scoring judge (``gold``),
logged as ``eval/win_rate_vs_sft`` (with the tie and lose rates)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback

from trl_ppomax.base import metrics as M
from trl_ppomax.base.core import ends_with_stop
from trl_ppomax.data import rows_of_this_process
from trl_ppomax.data.files import read_json, write_json
from trl_ppomax.judging.base import VERDICTS, margin_verdict
from trl_ppomax.judging.scored import ScoreJudge
from trl_ppomax.ppo.setup import prepare_eval_prompts
from trl_ppomax.rewards import decode_texts

logger = logging.getLogger(__name__)


class WinRateCallback(TrainerCallback):
    """``trainer.add_callback(WinRateCallback(trainer, judge="rm", every=10))``.

    The SFT answers are the policy's own before its first update, kept in ``output_dir/win_rate_baseline/`` for a
    resumed run. Each check samples the policy on the same prompts (training sampling settings, a fixed seed, the
    training random streams untouched) and counts ``win`` per prompt if ``score(policy) − score(SFT) > tie_threshold``.
    ``judge``: ``"rm"`` (the trainer's score, after the missing-stop-token penalty) or a ``ScoreJudge`` such as
    ``FunctionJudge(gold_rewards)``. ``prompts``: the first ``num_prompts`` of a prompt dataset (default: the trainer's
    ``eval_dataset``, else its training prompts)."""

    def __init__(
        self,
        trainer,
        judge="rm",
        every: int = 10,
        prompts: Dataset | None = None,
        num_prompts: int = 64,
        tie_threshold: float = 0.0,
    ) -> None:
        if every < 1:
            raise ValueError(f"WinRateCallback(every={every}): check every N ≥ 1 iterations.")
        if not (judge == "rm" or isinstance(judge, ScoreJudge)):
            raise ValueError(f"WinRateCallback(judge={judge!r}): use 'rm' or a ScoreJudge such as FunctionJudge(f).")
        self.trainer, self.every, self.judge, self.tie_threshold = trainer, every, judge, tie_threshold
        default = trainer.eval_dataset if isinstance(trainer.eval_dataset, Dataset) else trainer.train_dataset
        dataset = prepare_eval_prompts(trainer, prompts) if prompts is not None else default
        self.dataset = dataset.select(range(min(num_prompts, len(dataset))))
        self.baseline: list[float] | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        path = Path(args.output_dir) / "win_rate_baseline" / f"process-{self.trainer.accelerator.process_index}.json"
        if path.exists():
            self.baseline = read_json(path)["scores"]
        elif state.global_step == 0:
            self.baseline = self.scores(seed=args.seed)
            write_json(path, {"scores": self.baseline})
        else:
            logger.warning(
                "WinRateCallback: resumed without %s; the SFT answers are unknown, no win rate is logged.", path
            )

    def on_step_end(self, args, state, control, **kwargs):
        if self.baseline is None or state.global_step % self.every:
            return
        rates = self.rates(self.scores(seed=args.seed))
        should_log = control.should_log  # logging resets it; the iteration's own log must still happen
        self.trainer.log({**rates, M.EPISODE: state.episode})
        control.should_log = should_log
        return control

    def rates(self, scores: list[float]) -> dict[str, float]:
        """Win, tie and lose shares over every process's prompts (padding rows weigh 0)."""
        _, weights = rows_of_this_process(len(self.dataset), self.trainer.accelerator)
        counts = torch.zeros(4)
        for policy, sft, weight in zip(scores, self.baseline, weights, strict=True):
            counts[VERDICTS.index(margin_verdict(policy, sft, self.tie_threshold))] += weight
        counts = self.trainer.reduce_sum(counts.to(self.trainer.accelerator.device)).cpu()
        shares = (counts[:3] / counts[:3].sum().clamp(min=1e-12)).tolist()
        return dict(zip((M.WIN_RATE_VS_SFT, M.TIE_RATE_VS_SFT, M.LOSE_RATE_VS_SFT), shares, strict=True))

    @torch.no_grad()
    def scores(self, seed: int) -> list[float]:
        """This process's prompts answered by the current policy (sampled under ``seed``) and scored by the judge."""
        trainer = self.trainer
        rows, _ = rows_of_this_process(len(self.dataset), trainer.accelerator)
        devices = [trainer.accelerator.device] if trainer.accelerator.device.type == "cuda" else []
        chunk, out = trainer.args.local_rollout_forward_batch_size, []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed + trainer.accelerator.process_index)
            for start in range(0, len(rows), chunk):
                rollout = trainer.rollout_rows(self.dataset, rows[start : start + chunk], sampling=True)
                out += self.score_rollout(rollout, rows[start : start + chunk])
        return out

    def score_rollout(self, rollout, rows: list[int]) -> list[float]:
        if self.judge == "rm":
            return rollout.scores.float().tolist()
        tokenizer = self.trainer.processing_class
        if "prompt" in self.dataset.column_names:
            prompts = [self.dataset[i]["prompt"] for i in rows]
        else:
            prompts = decode_texts(tokenizer, rollout.query_ids, rollout.query_mask)
        answers = decode_texts(tokenizer, rollout.response_ids, rollout.response_mask)
        finished = (
            ends_with_stop(rollout.response_ids, rollout.response_mask, self.trainer.end_token_id).bool().tolist()
        )
        return self.judge.score(prompts, answers, finished)
