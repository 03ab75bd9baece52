"""Bounded-staleness rollouts (``max_staleness = k ≥ 1``): a producer thread generates rollout batch ``j`` with a copy
of the policy at **version** ``max(0, j − 1 − k)`` (the weights after that many iterations; the synchronous loop,
k = 0, samples batch ``j`` with version ``j − 1``) while the trainer scores and updates the batches before it, as
verl's one-step-off pipeline does with a fixed lag, so that a run is reproducible and resumable.

Schedule: at the start of iteration ``i`` the batches up to ``i + k`` are asked for, and a snapshot of the live policy
(version ``i − 1``) is queued before the first batch that needs it; the producer loads it into its copy once it has
finished the older batches, so the trainer waits for nothing but the batch it trains on.
Each batch keeps the version that sampled it and the **behaviour** log-probs ``log μ(y_t)`` of that copy. The trainer
scores it with the current policy (``log π_prox``, the reference, the critic, the rewards), and the update uses the
decoupled PPO objective (AReaL, arXiv 2505.24298): the clipped ratio ``π_θ / π_prox`` times the behaviour weight
``w_t = π_prox(y_t) / μ(y_t)``, truncated at ``C`` (``"tis"``) or zero outside ``[1/C, C]`` (``"icepop"``).

Sampling draws from a generator seeded by ``(seed, batch, process)`` (Gumbel-max over the processed scores, so no
global random state is shared with the trainer's thread): a batch is the same whenever it is generated. A checkpoint
holds the finished batches not yet trained on (``lagged_rollouts_<process>.pt``); the next one asked for after a resume
needs the resumed weights.

One idea, one word: the **producer** (:class:`LaggedRollouts`) writes rollouts **ahead** of the trainer, each at most
``max_staleness`` versions **stale**; the module, the class and ``trainer.lagged`` keep their names (public, and the
checkpoint's file names), everything else says "producer"."""

from __future__ import annotations

import atexit
import copy
import logging
import os
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from statistics import fmean as mean

import torch
from torch import nn
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from trl_ppomax import data
from trl_ppomax.base import core
from trl_ppomax.base import metrics as M
from trl_ppomax.base.rollout import Generated
from trl_ppomax.generation import HFGeneration, generate_in_chunks

__all__ = [
    "GumbelSampler",
    "LaggedRollouts",
    "PolicyCopy",
    "ProducerStopped",
    "StopRequested",
    "behaviour_weights",
]

logger = logging.getLogger(__name__)
QUEUE_FILE = "lagged_rollouts_{}.pt"
#: How each sampling statistic of :meth:`LaggedRollouts.importance_weights` is reduced over an iteration's calls.
REDUCERS = {M.SAMPLING_LOGP_DIFF_MAX: max, M.IS_RATIO_MAX: max, M.IS_RATIO_MIN: min, M.STALENESS_MAX: max}


def behaviour_weights(prox_logprobs, behaviour_logprobs, mask, cap: float, correction: str = "tis") -> torch.Tensor:
    """Per-token weights (B, T) of the decoupled objective, ``ρ_t = exp(log π_prox − log μ)``: ``min(ρ_t, C)``
    (``"tis"``, truncated importance sampling) or ``ρ_t·[1/C ≤ ρ_t ≤ C]`` (``"icepop"``: tokens too far off-policy
    dropped, arXiv 2510.18855); 1 outside ``mask``."""
    if correction == "tis":
        return core.truncated_importance_weights(prox_logprobs, behaviour_logprobs, mask, cap)
    ratio = torch.exp(prox_logprobs - behaviour_logprobs)
    kept = (ratio >= 1 / cap) & (ratio <= cap)
    return torch.where(mask.bool(), ratio * kept, torch.ones_like(ratio))


class GumbelSampler(LogitsProcessor):
    """The last processor of a lagged rollout: ``s_v + g_v`` with Gumbel noise ``g = −log(−log u)`` drawn from its own
    ``generator``, so that greedy decoding picks ``argmax_v (s_v + g_v)``, a sample of ``softmax(s)`` (Gumbel-max)."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        uniform = torch.rand(scores.shape, generator=self.generator, device=scores.device)
        gumbel = -torch.log(-torch.log(uniform.clamp_(min=torch.finfo(uniform.dtype).tiny)))
        return scores.float() + gumbel


class ProducerStopped(Exception):
    """Raised inside the producer's generation once :meth:`LaggedRollouts.close` has asked it to stop."""


class StopRequested(StoppingCriteria):
    """Ends every row of a ``generate`` call at its next token once ``event`` is set (the producer told to stop), so
    that the producer never stays inside ``generate`` for a whole batch after the trainer has stopped."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class SeededGeneration(HFGeneration):
    """:class:`HFGeneration` on the producer's copy of the policy, sampling with :class:`GumbelSampler` (greedy
    decoding over Gumbel noise), stopped early by :class:`StopRequested` once ``stopping`` is set."""

    generator: torch.Generator | None = None
    stopping: threading.Event | None = None

    def generation_kwargs(self, sampling: bool = True, prompt_width: int = 0) -> dict:
        kwargs = super().generation_kwargs(sampling, prompt_width)
        if sampling:
            processors = LogitsProcessorList([*kwargs.pop("logits_processor"), GumbelSampler(self.generator)])
            kwargs.update(do_sample=False, logits_processor=processors)
            for name in ("temperature", "top_k", "top_p"):
                kwargs.pop(name)
        if self.stopping is not None:
            kwargs["stopping_criteria"] = StoppingCriteriaList([StopRequested(self.stopping)])
        return kwargs

    def generate(self, query_ids, query_mask, sampling: bool = True, n: int = 1, max_new_tokens=None):
        """``n`` samples of each prompt, (B·n, T), row ``i·n + j`` the ``j``-th of prompt ``i``: the prompts are
        repeated ``n`` times first, since greedy decoding (Gumbel-max is greedy over noisy scores) returns one sequence
        per prompt (``num_return_sequences`` > 1 needs ``do_sample``). The batch's ``generator`` draws every row's
        noise, so a batch is the same whenever it is generated. Raises :class:`ProducerStopped` once stopped."""
        if self.stopping is not None and self.stopping.is_set():
            raise ProducerStopped
        if n > 1:
            query_ids, query_mask = query_ids.repeat_interleave(n, 0), query_mask.repeat_interleave(n, 0)
        return super().generate(query_ids, query_mask, sampling, 1, max_new_tokens)


class PolicyCopy(SeededGeneration):
    """The producer's engine with ``model.generate``: a frozen copy of the live policy whose trainable weights take
    the snapshots the schedule names; ``log μ`` is the copy's scoring forward (``behaviour``, as ``π_prox``'s).

    The producer's engine interface (also :class:`~trl_ppomax.generation.vllm.VLLMEngine`'s, colocated):
    ``generator`` (the batch's random stream), ``generate``, ``behaviour_logprobs``, ``target_logprobs`` (what
    ``log μ`` estimates under the scoring policy), ``snapshot()`` (trainer's thread) and ``load_snapshot``."""

    def __init__(self, policy: nn.Module, args, stop_token_id, pad_token_id, behaviour) -> None:
        super().__init__(copy.deepcopy(policy).eval().requires_grad_(False), args, stop_token_id, pad_token_id)
        self.live, self.behaviour = policy, behaviour

    def behaviour_logprobs(self, query_ids, query_mask, responses, mask, sampler_logprobs) -> torch.Tensor:
        return self.behaviour(self.policy, query_ids, query_mask, responses, mask)

    def target_logprobs(self, policy_logits, logprobs, responses) -> torch.Tensor:
        return logprobs

    def snapshot(self) -> list[torch.Tensor]:
        """The live policy's trainable parameters (the others never change), cloned."""
        return [p.detach().clone() for p in self.live.parameters() if p.requires_grad]

    def load_snapshot(self, weights: list[torch.Tensor]) -> None:
        trainable = [mine for mine, live in zip(self.policy.parameters(), self.live.parameters(), strict=True)
                     if live.requires_grad]  # fmt: skip
        with torch.no_grad():
            for mine, weight in zip(trainable, weights, strict=True):
                mine.copy_(weight)


@dataclass
class Produced:
    """Rollout batch ``index`` as the producer finished it: what it wrote (the prompts repeated, the behaviour
    log-probs as the sampler's), the policy version that sampled it, and its generation time."""

    index: int
    generated: Generated
    version: int
    seconds: float


class LaggedRollouts:
    """The producer of bounded-staleness rollouts for one trainer process (see the module docstring).

    Args:
        engine: what samples, at the versions the schedule names: :class:`PolicyCopy` or a colocated
            :class:`~trl_ppomax.generation.vllm.VLLMEngine` (its interface in :class:`PolicyCopy`).
        args: the run's config (``max_staleness``, sampling settings, ``seed``, the correction).
        prompts: ``f(j) -> (query_ids, query_mask, columns)`` of rollout batch ``j``.
        autocast: the run's mixed-precision context (thread-local, so entered again in the producer).

    The producer runs until :meth:`close`, which the trainer calls when training ends, on any error and on Ctrl-C,
    and which also runs at exit as a last resort: a thread still inside torch when the interpreter shuts down aborts
    the process (SIGABRT, "terminate called without an active exception").
    """

    #: How long :meth:`close` waits for the producer (a colocated vLLM engine finishes the request it is running).
    close_timeout = 60.0

    def __init__(self, engine, args, prompts, autocast, process=0) -> None:
        self.engine, self.args, self.lag, self.process_index = engine, args, args.max_staleness, process
        self.prompts, self.autocast = prompts, autocast
        self.version, self.asked, self.taken = 0, 0, 0  # the engine's version; batches asked for and trained on
        self.queued_version: int | None = None  # the version of the last snapshot queued (None: none yet)
        self.finished: dict[int, Produced] = {}
        self.stats: dict[str, list[float]] = defaultdict(list)
        self.requests: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.ready = threading.Condition()
        self.stopping = threading.Event()  # set by close(): the producer ends its generation at the next token
        if isinstance(engine, SeededGeneration):
            engine.stopping = self.stopping
        self.thread = threading.Thread(target=self._produce, name="trl-ppomax-rollouts", daemon=True)
        self.thread.start()
        atexit.register(self.close)

    def version_for(self, batch: int) -> int:
        """The policy version that samples rollout batch ``batch``: ``max(0, batch − 1 − k)``."""
        return max(0, batch - 1 - self.lag)

    # -- the trainer's side -------------------------------------------------------------------------------------------
    def generate(self, prompts=None, *, iteration: int, sampling: bool = True, n: int = 1) -> Generated:
        """Rollout batch ``iteration`` (a :class:`~trl_ppomax.generation.RolloutSource`): the producer reads
        its own prompts, so ``prompts`` is ignored; it always samples ``num_samples_per_prompt`` each."""
        return self.take(iteration, self.args.num_total_batches).generated

    def take(self, iteration: int, last: int) -> Produced:
        """Rollout batch ``iteration``, once generated; first asks for every batch up to ``iteration + k`` (at most
        ``last``), a snapshot of the live policy (version ``iteration − 1``) queued before the first that needs it:
        the producer loads it once it has finished the older batches, and the trainer never waits for that."""
        for batch in range(self.asked + 1, min(iteration + self.lag, last) + 1):
            if self.version_for(batch) != self.queued_version:
                self.queued_version = self.version_for(batch)
                self.requests.put((self.queued_version, self.engine.snapshot()))
            self.requests.put(batch)
            self.asked = batch
        start = time.perf_counter()
        self._wait(lambda: iteration in self.finished)
        self.stats[M.ROLLOUT_WAIT_SECONDS].append(time.perf_counter() - start)
        with self.ready:
            produced = self.finished.pop(iteration)
            self.taken += 1
        age = iteration - 1 - produced.version
        self.stats[M.STALENESS_MEAN].append(age)
        self.stats[M.STALENESS_MAX].append(age)
        self.stats[M.GENERATION_SECONDS].append(produced.seconds)
        return produced

    def load_weights(self, version: int, snapshot) -> None:
        """The engine at ``version``: ``snapshot`` (the engine's ``snapshot()`` of the live policy) loaded into it."""
        self.engine.load_snapshot(snapshot)
        self.version = version

    def importance_weights(self, policy_logits, logprobs, responses, mask, behaviour_logprobs) -> torch.Tensor:
        """:func:`behaviour_weights` of the scored log-probs (``π_prox``) over the behaviour ones, logging the gap."""
        args = self.args
        logprobs = self.engine.target_logprobs(policy_logits, logprobs, responses)
        weights = behaviour_weights(
            logprobs, behaviour_logprobs, mask, args.staleness_clip_max, args.staleness_correction
        )
        real = mask.bool()
        gap, ratios = (logprobs - behaviour_logprobs).abs()[real], torch.exp(logprobs - behaviour_logprobs)[real]
        if gap.numel():
            values = torch.stack([gap.mean(), gap.max(), ratios.mean(), ratios.min(), ratios.max()]).tolist()
            names = (M.SAMPLING_LOGP_DIFF_MEAN, M.SAMPLING_LOGP_DIFF_MAX, M.IS_RATIO_MEAN, M.IS_RATIO_MIN)
            for name, value in zip((*names, M.IS_RATIO_MAX), values, strict=True):
                self.stats[name].append(value)
            if args.staleness_correction == "icepop":
                self.stats[M.IS_DROPPED].append(float((weights[real] == 0).float().mean()))
        return weights

    def pop_metrics(self) -> dict[str, float]:
        """This iteration's staleness, timing and sampling statistics, and the engine's own (vLLM's times)."""
        out = {name: REDUCERS.get(name, mean)(values) for name, values in self.stats.items() if values}
        self.stats.clear()
        return {**self.engine.pop_metrics(), **out}

    def save(self, folder: str, process_index: int) -> None:
        """The finished batches not yet trained on, after the producer has finished all it was asked for."""
        self._wait(self._idle)
        batches = {
            i: {"version": p.version, "seconds": p.seconds, **vars(p.generated)} for i, p in self.finished.items()
        }
        saved = {"version": self.version, "asked": self.asked, "produced": batches}
        torch.save(saved, os.path.join(folder, QUEUE_FILE.format(process_index)))

    def load(self, folder: str, process_index: int, iteration: int) -> None:
        """The state :meth:`save` wrote at the end of iteration ``iteration``; the copy gets the resumed weights."""
        saved = torch.load(os.path.join(folder, QUEUE_FILE.format(process_index)), weights_only=False)
        if "produced" in saved:
            self.finished = {index: produced_from(index, fields) for index, fields in saved["produced"].items()}
        else:  # written by an earlier release: one entry per batch, the prompts not yet repeated
            n = self.args.num_samples_per_prompt
            self.finished = {b["index"]: produced_from_batch(b, n) for b in saved["batches"]}
        self.asked, self.taken = saved["asked"], saved["asked"] - len(self.finished)
        self.queued_version = iteration
        self.load_weights(iteration, self.engine.snapshot())

    def close(self) -> None:
        """Stop the producer and wait for it (at most ``close_timeout`` s): the batch it is generating ends at its
        next token (:class:`StopRequested`; a vLLM engine finishes its request) and is dropped, as are the batches not
        started. Idempotent; a second Ctrl-C while it waits leaves the wait to the call at exit."""
        self.stopping.set()
        self.requests.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join(self.close_timeout)
        if self.thread.is_alive():
            logger.warning(
                "The rollout producer is still generating %.0f s after it was told to stop.", self.close_timeout
            )
        else:
            atexit.unregister(self.close)

    # -- the producer's side ------------------------------------------------------------------------------------------
    def _idle(self) -> bool:
        """Whether the producer has finished every batch it was asked for."""
        return self.asked == len(self.finished) + self.taken

    def _wait(self, condition) -> None:
        """Block until ``condition()`` holds; the producer's error, if it failed, is raised here (never a hang)."""
        with self.ready:
            while not condition():
                if self.error is not None:
                    raise RuntimeError(f"The rollout producer failed: {self.error!r}") from self.error
                if not self.thread.is_alive():
                    raise RuntimeError("The rollout producer stopped before generating the batches asked for.")
                self.ready.wait(timeout=1.0)

    def _produce(self) -> None:
        try:
            while (batch := self.requests.get()) is not None and not self.stopping.is_set():
                if isinstance(batch, tuple):  # (version, weights): the snapshot the next batches need
                    self.load_weights(*batch)
                    continue
                generated = self._generate(batch)
                if self.stopping.is_set():  # cut short by close(): not a batch
                    break
                with self.ready:
                    self.finished[batch] = generated
                    self.ready.notify_all()
        except ProducerStopped:
            pass
        except BaseException as error:  # told to the trainer, which raises it
            with self.ready:
                self.error = error
                self.ready.notify_all()

    def _generate(self, batch: int) -> Produced:
        args, n = self.args, self.args.num_samples_per_prompt
        query_ids, query_mask, columns = self.prompts(batch)
        seed = hash((args.seed, batch, self.process_index)) % 2**63
        self.engine.generator = torch.Generator(device=query_ids.device).manual_seed(seed)
        start = time.perf_counter()
        with torch.no_grad(), self.autocast():
            pad_id = self.engine.pad_token_id
            responses, mask, sampler = generate_in_chunks(self.engine, query_ids, query_mask, True, n, args, pad_id)
            queries = (query_ids.repeat_interleave(n, 0), query_mask.repeat_interleave(n, 0))
            behaviour = self.engine.behaviour_logprobs(*queries, responses, mask, sampler)
        seconds = time.perf_counter() - start
        generated = Generated(*queries, responses, mask, behaviour, columns=data.repeat_rows(columns, n))
        return Produced(batch, generated, self.version, seconds)


def produced_from(index: int, saved: dict) -> Produced:
    """Batch ``index`` from what :meth:`LaggedRollouts.save` wrote of it."""
    saved = dict(saved)
    version, seconds = saved.pop("version"), saved.pop("seconds")
    return Produced(index, Generated(**saved), version, seconds)


def produced_from_batch(batch: dict, n: int) -> Produced:
    """A :class:`Produced` from a queue file of an earlier release (one dict per batch: the prompts (B, L) not yet
    repeated, ``behaviour_logprobs``, ``columns`` per prompt), so that its checkpoints still resume."""
    queries = batch["query_ids"].repeat_interleave(n, 0), batch["query_mask"].repeat_interleave(n, 0)
    responses = batch["response_ids"], batch["response_mask"], batch["behaviour_logprobs"]
    generated = Generated(*queries, *responses, columns=data.repeat_rows(batch["columns"], n))
    return Produced(batch["index"], generated, batch["version"], batch["seconds"])
