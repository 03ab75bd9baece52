"""max_staleness (issue 34): bounded-staleness rollouts from a producer thread — the synchronous loop unchanged at 0,
the fixed-lag schedule, the decoupled objective's behaviour weights, resume, a failing producer, the refusals."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import PolicyVersions, StopAt, make_trainer
from torch.testing import assert_close

from trl_ppomax import PPOMaxConfig
from trl_ppomax.base import metrics as M
from trl_ppomax.generation import lagged
from trl_ppomax.generation.lagged import GumbelSampler, behaviour_weights
from trl_ppomax.ppo import checks
from trl_ppomax.ppo.scoring import policy_logprobs

LAGGED = dict(total_episodes=64)  # four iterations of 16 responses


def final_numbers(trainer) -> tuple[list[dict], dict]:
    """A finished run's logged losses and rewards, and its policy weights."""
    logs = [e for e in trainer.state.log_history if M.POLICY_LOSS in e]
    keep = (M.POLICY_LOSS, M.VALUE_LOSS, M.SCORES, M.KL)
    return [{k: e[k] for k in keep} for e in logs], trainer.model.policy.state_dict()


def test_max_staleness_0_is_the_synchronous_loop_bit_for_bit(tmp_path, monkeypatch):
    """``max_staleness=0`` builds no producer and runs the loop of a config that never names it: the same samples,
    losses and weights, bit for bit, side by side in this process (a recorded reference would hold another CPU's
    float kernels)."""
    synchronous = make_trainer(tmp_path / "synchronous", **LAGGED)
    synchronous.train()
    monkeypatch.setattr(lagged.LaggedRollouts, "__init__", lambda *a, **k: pytest.fail("a producer was built"))
    zero = make_trainer(tmp_path / "zero", max_staleness=0, **LAGGED)
    zero.train()
    assert zero.lagged is None and synchronous.args.max_staleness == 0
    (logs, weights), (expected_logs, expected) = final_numbers(zero), final_numbers(synchronous)
    assert logs == expected_logs and len(logs) == 4
    assert all(torch.equal(weights[name], value) for name, value in expected.items())


@pytest.mark.parametrize("k", [1, 2])
def test_batch_i_is_sampled_by_version_i_minus_1_minus_k_exactly(tmp_path, k):
    """The schedule max(0, i − 1 − k), and each batch's behaviour log-probs are those of that version's weights (so
    the sampler really was that version); the staleness is logged."""
    trainer = make_trainer(tmp_path, max_staleness=k, **LAGGED)
    versions = PolicyVersions(trainer)
    trainer.add_callback(versions)
    taken = []
    take = trainer.lagged.take
    trainer.lagged.take = lambda iteration, last: taken.append(take(iteration, last)) or taken[-1]
    trainer.train()
    assert [(b.index, b.version) for b in taken] == [(i, max(0, i - 1 - k)) for i in range(1, 5)]
    model = trainer.model.policy
    saved = versions.copy()
    for batch in taken:
        model.load_state_dict(versions.versions[batch.version])
        out = batch.generated  # the prompts repeated num_samples_per_prompt times, as scoring reads them
        with torch.no_grad():
            expected = policy_logprobs(
                model, out.query_ids, out.query_mask, out.response_ids, out.response_mask, trainer.args
            )
        assert torch.equal(expected, out.sampler_logprobs), batch.index
    model.load_state_dict(saved)
    staleness = [e[M.STALENESS_MAX] for e in trainer.state.log_history if M.STALENESS_MAX in e]
    assert staleness == [min(i - 1, k) for i in range(1, 5)]
    assert all(e[M.UPDATE_SECONDS] > 0 and M.ROLLOUT_WAIT_SECONDS in e for e in trainer.state.log_history[:4])


def test_a_lagged_run_trains_and_corrects_with_behaviour_weights(tmp_path):
    trainer = make_trainer(tmp_path, max_staleness=1, **LAGGED)
    before = {n: p.clone() for n, p in trainer.model.policy.named_parameters()}
    seen = []
    weights = trainer.lagged.importance_weights
    trainer.lagged.importance_weights = lambda *a: seen.append(weights(*a)) or seen[-1]
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.policy.named_parameters())
    first, later = seen[0], torch.cat([w.flatten() for w in seen[1:]])
    assert torch.equal(first, torch.ones_like(first))  # batch 1: the sampler is the scoring policy
    assert (later != 1).any()  # then the copy lags one version behind
    logged = trainer.state.log_history[2]
    assert logged[M.IS_RATIO_MIN] <= logged[M.IS_RATIO_MEAN] <= logged[M.IS_RATIO_MAX]
    assert logged[M.SAMPLING_LOGP_DIFF_MEAN] > 0


def test_behaviour_weights_by_hand():
    """ρ = exp(prox − behaviour) = [2, 0.25, 4, 1] (the last token masked): tis caps at C = 3 → [2, 0.25, 3, 1];
    icepop drops what lies outside [1/3, 3] → [2, 0, 0, 1]."""
    behaviour = torch.zeros(1, 4)
    prox = torch.log(torch.tensor([[2.0, 0.25, 4.0, 7.0]]))
    mask = torch.tensor([[1, 1, 1, 0]])
    assert_close(behaviour_weights(prox, behaviour, mask, 3.0, "tis"), torch.tensor([[2.0, 0.25, 3.0, 1.0]]))
    assert_close(behaviour_weights(prox, behaviour, mask, 3.0, "icepop"), torch.tensor([[2.0, 0.0, 0.0, 1.0]]))


def test_importance_metrics_by_hand():
    """The logged gap and ratios of one call: |log ρ| = [ln 2, ln 4] → mean 1.5·ln 2, max ln 4; ρ mean 1.25."""
    producer = SimpleNamespace(
        args=SimpleNamespace(staleness_clip_max=3.0, staleness_correction="icepop"),
        stats=lagged.defaultdict(list),
        engine=SimpleNamespace(target_logprobs=lambda logits, logprobs, responses: logprobs, pop_metrics=dict),
    )
    prox = torch.log(torch.tensor([[2.0, 0.5, 9.0]]))
    mask = torch.tensor([[1, 1, 0]])
    lagged.LaggedRollouts.importance_weights(producer, None, prox, None, mask, torch.zeros(1, 3))
    stats = lagged.LaggedRollouts.pop_metrics(producer)
    ln2 = torch.log(torch.tensor(2.0)).item()
    assert stats[M.SAMPLING_LOGP_DIFF_MEAN] == pytest.approx(ln2) and stats[M.SAMPLING_LOGP_DIFF_MAX] == pytest.approx(
        ln2
    )
    assert stats[M.IS_RATIO_MEAN] == pytest.approx(1.25) and stats[M.IS_RATIO_MIN] == pytest.approx(0.5)
    assert stats[M.IS_RATIO_MAX] == pytest.approx(2.0) and stats[M.IS_DROPPED] == 0.0


def test_icepop_drops_tokens_in_a_run(tmp_path):
    trainer = make_trainer(tmp_path, max_staleness=1, staleness_correction="icepop", staleness_clip_max=1.01, **LAGGED)
    trainer.train()
    dropped = [e[M.IS_DROPPED] for e in trainer.state.log_history if M.IS_DROPPED in e]
    assert dropped[0] == 0 and max(dropped[1:]) > 0


def test_gumbel_max_samples_the_softmax():
    """argmax(s + Gumbel) over 40,000 draws hits each token at its softmax probability (±0.01), and the same
    generator seed gives the same draws."""
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(40_000, 4).clone()
    draws = GumbelSampler(torch.Generator().manual_seed(0))(None, scores.clone()).argmax(-1)
    assert_close(
        torch.bincount(draws, minlength=4) / 40_000.0, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.01, rtol=0
    )
    again = GumbelSampler(torch.Generator().manual_seed(0))(None, scores.clone()).argmax(-1)
    assert torch.equal(draws, again)


@pytest.mark.slow  # six tiny runs (.ci/run runs it)
@pytest.mark.parametrize("k", [1, 2])
def test_kill_and_resume_is_bit_identical_for_a_fixed_lag(tmp_path, k):
    """Stopped after iteration 2 (the batches generated ahead saved in the checkpoint) and resumed: the weights of
    the uninterrupted run with the same k."""
    settings = dict(max_staleness=k, save_strategy="steps", save_steps=1, **LAGGED)
    whole = make_trainer(tmp_path / "whole", **settings)
    whole.train()
    stopped = make_trainer(tmp_path / "cut", callbacks=[StopAt(2)], **settings)
    stopped.train()
    assert (tmp_path / "cut" / "out" / "checkpoint-2" / "lagged_rollouts_0.pt").is_file()
    resumed = make_trainer(tmp_path / "cut", **settings)
    resumed.train(resume_from_checkpoint=True)
    resumed_weights = resumed.model.policy.state_dict()
    for name, weight in whole.model.policy.state_dict().items():
        assert torch.equal(weight, resumed_weights[name]), name


def test_resuming_with_another_lag_is_refused(tmp_path):
    stopped = make_trainer(tmp_path, callbacks=[StopAt(1)], max_staleness=1, save_strategy="steps", save_steps=1)
    stopped.train()
    with pytest.raises(ValueError, match="max_staleness"):
        make_trainer(tmp_path, max_staleness=2, save_strategy="steps", save_steps=1).train(resume_from_checkpoint=True)


def test_a_failing_producer_stops_training_with_its_error(tmp_path):
    trainer = make_trainer(tmp_path, max_staleness=1, **LAGGED)
    generate = trainer.lagged.engine.generate

    def broken(query_ids, *args):
        if trainer.lagged.asked >= 3:
            raise OSError("disk on fire")
        return generate(query_ids, *args)

    trainer.lagged.engine.generate = broken
    with pytest.raises(RuntimeError, match=r"rollout producer failed.*disk on fire"):
        trainer.train()
    assert trainer.state.global_step == 2  # batches 1 and 2 trained; batch 3's generation failed


def test_the_producer_is_stopped_and_joined_when_training_ends(tmp_path):
    trainer = make_trainer(tmp_path, max_staleness=1, total_episodes=32)
    trainer.train()
    assert not trainer.lagged.thread.is_alive()  # joined by train(), not by hand


def test_the_producer_is_joined_when_a_reward_function_raises(tmp_path):
    calls = []

    def reward(prompts, completions, **_):
        calls.append(len(prompts))
        if len(calls) == 2:
            raise ZeroDivisionError("the reward server divided by zero")
        return [0.5] * len(prompts)

    trainer = make_trainer(tmp_path, reward=reward, max_staleness=1, advantage_estimator="reinforce_pp", **LAGGED)
    with pytest.raises(ZeroDivisionError, match="divided by zero"):
        trainer.train()
    assert not trainer.lagged.thread.is_alive() and trainer.state.global_step == 1


def test_close_ends_a_generation_in_progress_at_its_next_token(tmp_path):
    """close() while the producer is inside ``generate`` (held at its third token): generation ends at the next
    token (StopRequested) instead of running on to response_length, the batch is dropped, the thread joined."""
    trainer = make_trainer(tmp_path, max_staleness=1, total_episodes=32, response_length=100, stop_token=None)
    producer = trainer.lagged
    inside, forwards = threading.Event(), []

    def hold_at_the_third_token(module, inputs, output):
        forwards.append(1)
        if len(forwards) == 3:
            inside.set()
            producer.stopping.wait(30)  # until close() is called

    hook = producer.engine.policy.register_forward_hook(hold_at_the_third_token)
    producer.requests.put(1)
    assert inside.wait(60)
    producer.close()
    hook.remove()
    assert not producer.thread.is_alive() and producer.error is None
    assert 1 not in producer.finished
    assert len(forwards) <= 5  # the held token, at most one more, and the behaviour log-probs' forward; not 100
    producer.close()  # idempotent


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_a_group_estimator_trains_with_lagged_rollouts(tmp_path, name):
    """max_staleness ≥ 1 with num_samples_per_prompt ≥ 2 (every group estimator): the producer samples each prompt
    n times over Gumbel noise (greedy decoding cannot return n sequences), each row its own noise, and the behaviour
    log-probs are those of the sampling version."""
    trainer = make_trainer(tmp_path, advantage_estimator=name, num_samples_per_prompt=2, max_staleness=1, **LAGGED)
    taken = []
    take = trainer.lagged.take
    trainer.lagged.take = lambda iteration, last: taken.append(take(iteration, last)) or taken[-1]
    before = {n: p.clone() for n, p in trainer.model.policy.named_parameters()}
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.policy.named_parameters())
    assert trainer.state.global_step == 4 and all(M.POLICY_LOSS in e for e in trainer.state.log_history[:4])
    first = taken[0].generated
    assert torch.equal(first.query_ids[0::2], first.query_ids[1::2])  # each prompt twice in a row
    pairs = first.response_ids.view(first.query_ids.shape[0] // 2, 2, -1)
    assert (pairs[:, 0] != pairs[:, 1]).any()  # a prompt's two samples are two draws, not one repeated
    trained = {n: p.clone() for n, p in trainer.model.policy.state_dict().items()}
    trainer.model.policy.load_state_dict(before, strict=False)  # version 0 sampled batch 1
    queries = (first.query_ids, first.query_mask)
    with torch.no_grad():
        expected = policy_logprobs(
            trainer.model.policy, *queries, first.response_ids, first.response_mask, trainer.args
        )
    trainer.model.policy.load_state_dict(trained)
    assert torch.equal(expected, first.sampler_logprobs)


def test_max_staleness_with_a_vllm_server_or_a_sharded_engine_is_refused_and_everyday_setups_pass(tmp_path):
    vllm = dict(output_dir=str(tmp_path), max_staleness=1, use_vllm=True, report_to="none")
    for setting in ({"vllm_mode": "server"}, {"vllm_enable_sleep_mode": True}, {"vllm_tensor_parallel_size": 2}):
        with pytest.raises(ValueError, match=f"{next(iter(setting))}.*not supported"):
            PPOMaxConfig(**vllm, **setting)
    assert PPOMaxConfig(**vllm).vllm_mode == "colocate"  # a colocated engine generates ahead (tests/test_vllm.py)
    zero3 = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3)))
    with pytest.raises(ValueError, match="ZeRO-3"):
        checks.check_producer_engine(False, zero3)
    with pytest.raises(ValueError, match="FSDP"):
        checks.check_producer_engine(True, SimpleNamespace(state=SimpleNamespace()))
    zero2 = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2)))
    checks.check_producer_engine(False, zero2)  # ZeRO-2 and plain processes hold the whole policy
    checks.check_producer_engine(False, SimpleNamespace(state=SimpleNamespace()))
    with pytest.raises(ValueError, match="max_staleness must be"):
        PPOMaxConfig(output_dir=str(tmp_path), max_staleness=-1, report_to="none")


@pytest.mark.slow  # a LoRA run (.ci/run runs it)
def test_a_lagged_peft_policy_trains_its_adapter(tmp_path):
    from peft import LoraConfig

    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = make_trainer(tmp_path, peft_config=peft, max_staleness=1, **LAGGED)
    trainer.train()
    adapters = {n: p for n, p in trainer.lagged.engine.policy.named_parameters() if "lora_B" in n}
    assert adapters and any((p != 0).any() for p in adapters.values())  # the copy got the trained adapter


INTERRUPTED_RUN = """
import signal
import sys
# Ctrl-C as in a terminal, even where this test runs in a background job (which starts with SIGINT ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
from pathlib import Path
sys.path.insert(0, {tests!r})
from helpers import make_trainer
from transformers import TrainerCallback

class Announce(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        print("iteration", state.global_step, flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        print("iteration", state.global_step, flush=True)

def reward(prompts, completions, **_):
    if {fail_at_call} and len(calls) + 1 == {fail_at_call}:
        raise ZeroDivisionError("the reward server divided by zero")
    calls.append(1)
    return [0.5] * len(prompts)

calls = []
trainer = make_trainer(Path({folder!r}), reward=reward, callbacks=[Announce()], max_staleness=1,
                       advantage_estimator="reinforce_pp", total_episodes=16 * 200)
try:
    trainer.train()
finally:  # train() has joined the producer by now; nothing here joins it
    print("producer alive:", trainer.lagged.thread.is_alive(), flush=True)
"""


def run_interrupted(tmp_path, signal_name: str | None, after_iteration: int = 0, fail_at_call: int = 0):
    """A lagged tiny run in its own process, sent ``signal_name`` once iteration ``after_iteration`` has ended (0:
    as training begins, the producer inside its first batch), or whose reward raises at call ``fail_at_call``."""
    import os
    import signal
    import subprocess
    import sys

    script = INTERRUPTED_RUN.format(tests=str(Path(__file__).parent), folder=str(tmp_path), fail_at_call=fail_at_call)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    if signal_name is not None:
        for line in process.stdout:
            if line.strip() == f"iteration {after_iteration}".encode():
                break
        process.send_signal(getattr(signal, signal_name))
    out, err = process.communicate(timeout=180)
    return process.returncode, out.decode(), err.decode()


@pytest.mark.slow  # six training processes started and interrupted (.ci/run runs it)
@pytest.mark.parametrize("after_iteration", [0, 1, 3])
@pytest.mark.parametrize("attempt", [0, 1])
def test_ctrl_c_stops_and_joins_the_producer_at_any_moment(tmp_path, after_iteration, attempt):
    """Ctrl-C as training begins, after one and after three iterations (twice each): KeyboardInterrupt, the producer
    joined by train() itself, and never SIGABRT ("terminate called without an active exception", exit 134)."""
    returncode, out, err = run_interrupted(tmp_path, "SIGINT", after_iteration)
    assert "terminate called" not in err and returncode not in (134, -6), err[-2000:]
    assert "KeyboardInterrupt" in err and returncode != 0
    assert "producer alive: False" in out


@pytest.mark.slow  # a training process (.ci/run runs it)
def test_a_raising_reward_ends_a_lagged_run_without_sigabrt(tmp_path):
    returncode, out, err = run_interrupted(tmp_path, None, fail_at_call=3)
    assert "terminate called" not in err and returncode == 1, err[-2000:]
    assert "ZeroDivisionError: the reward server divided by zero" in err and "producer alive: False" in out


@pytest.mark.slow  # a training process (.ci/run runs it)
def test_sigterm_ends_a_lagged_run(tmp_path):
    returncode, _, _ = run_interrupted(tmp_path, "SIGTERM", after_iteration=1)
    import signal

    assert returncode == -signal.SIGTERM


def test_a_queue_file_of_an_earlier_release_still_resumes():
    """Before the producer kept Generated batches, a queue entry held the prompts once per prompt (B, L), the
    behaviour log-probs by that name and the columns per prompt: read back as the prompts repeated n times."""
    from trl_ppomax.generation.lagged import produced_from_batch

    old = {
        "index": 3, "version": 1, "seconds": 0.5,
        "query_ids": torch.tensor([[0, 5], [6, 7]]), "query_mask": torch.tensor([[0, 1], [1, 1]]),
        "response_ids": torch.arange(8).view(4, 2), "response_mask": torch.ones(4, 2, dtype=torch.long),
        "behaviour_logprobs": -torch.ones(4, 2), "columns": {"topic": ["a", "b"]},
    }  # fmt: skip
    produced = produced_from_batch(old, n=2)
    assert (produced.index, produced.version, produced.seconds) == (3, 1, 0.5)
    assert produced.generated.query_ids.tolist() == [[0, 5], [0, 5], [6, 7], [6, 7]]
    assert produced.generated.columns == {"topic": ["a", "a", "b", "b"]}
    assert torch.equal(produced.generated.sampler_logprobs, old["behaviour_logprobs"])
