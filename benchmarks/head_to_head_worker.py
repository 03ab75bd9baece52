"""One timed run for benchmarks/head_to_head.py: TRL 1.16's ``GRPOTrainer`` / ``RLOOTrainer`` (with TRL's fused
log-prob head, or with a plain completion-only log-softmax head) or ``PPOMaxTrainer`` (GRPO, RLOO or GAE advantages),
on identical work, in a fresh process.

Prints one line ``RESULT {json}`` at the end: the process's and ``train()``'s wall time, the time split by phase
(generation; the no-grad scoring forwards; the reward function; the update and the rest), the peak memory (and
its value when ``train()`` began: the libraries, the models and the trainer built), and the
work proof: what each trainer logged (optimizer steps, mean completion length) and what wrapping counted (generate
calls, completions, generated tokens, the rows of every forward by model and by grad mode, optimizer steps).

    python benchmarks/head_to_head_worker.py --impl trl_grpo --assets /tmp/h2h-assets
    python benchmarks/head_to_head_worker.py --check-plain-head   # the plain head against TRL's fused one

Everything is counted by wrapping public seams only: ``GenerationMixin.generate``, ``PreTrainedModel.__call__`` (the
outermost model call of each forward is counted: its rows, its model, whether autograd was on), the reward function
and torch's global optimizer-step hook. The policy is the causal LM inside ``trainer.model``, a critic the rest of
``trainer.model``, and any other model the reference.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import time
import types
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

PROCESS_START = time.perf_counter()

import torch  # noqa: E402

IMPLS = (
    "trl_grpo",
    "trl_grpo_plain",
    "trl_rloo",
    "trl_rloo_plain",
    "ppomax_grpo",
    "ppomax_rloo",
    "ppomax_gae",
)

# --------------------------------------------------------------------------------------------------------------------
# Assets: a user's folder (tokenizer saved beside the weights), built in code


def build_assets(
    folder: str | os.PathLike,
    *,
    vocab_size: int,
    hidden: int,
    layers: int,
    heads: int | None = None,
    intermediate: int | None = None,
    max_positions: int = 1024,
    seed: int = 0,
) -> Path:
    """``folder/policy``: a random Llama (``save_pretrained``) with a word-level tokenizer of ``vocab_size`` tokens saved
    beside it (the toy words, then filler words ``w0, w1, …``). Cached: built once per folder."""
    folder = Path(folder)
    policy = folder / "policy"
    if (policy / "config.json").exists() and (policy / "tokenizer_config.json").exists():
        return folder
    from transformers import LlamaForCausalLM

    from trl_ppomax.toyworld.tiny import SPECIALS, WORDS, llama_config, word_level_tokenizer

    words = [*SPECIALS, *WORDS]
    if vocab_size < len(words) + 1:
        raise ValueError(f"--vocab-size {vocab_size} is below the {len(words) + 1} tokens the prompts need.")
    tokenizer = word_level_tokenizer(words + [f"w{i}" for i in range(vocab_size - len(words))])
    heads = heads or max(2, hidden // 64)
    config = llama_config(
        tokenizer,
        hidden_size=hidden,
        layers=layers,
        heads=heads,
        intermediate_size=intermediate or 2 * hidden,
        max_position_embeddings=max_positions,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp / "policy")
    tokenizer.save_pretrained(tmp / "policy")
    folder.parent.mkdir(parents=True, exist_ok=True)
    if not (policy / "config.json").exists():
        tmp.rename(folder) if not folder.exists() else (tmp / "policy").rename(policy)
    return folder


def prompt_dataset(n: int):
    """``n`` text prompts (``prompt`` column) of 2–5 toy words: TRL's standard, non-conversational format."""
    from datasets import Dataset

    from trl_ppomax.toyworld.tiny import prompt_texts

    return Dataset.from_dict({"prompt": prompt_texts(n)})


def reward_characters(completions, **kwargs) -> list[float]:
    """Characters of each completion ÷ 100 (TRL's reward-function contract: ``completions`` as texts)."""
    return [len(c if isinstance(c, str) else c[0]["content"]) / 100 for c in completions]


# --------------------------------------------------------------------------------------------------------------------
# A plain completion-only log-softmax head in place of TRL's fused one


def add_plain_lm_head(model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False, outputs=("log_probs",)):
    """``trl.trainer.utils.add_fused_lm_head``'s contract with the model's own forward: ``model(..., labels=labels,
    fused_lm_head=True)`` runs the normal forward with ``logits_to_keep`` = the completion width + 1 (the labelled
    columns: TRL sets every label before the completion to -100) and returns a ``FusedCausalLMOutput`` whose
    ``log_probs`` / ``entropy`` (B, L − 1) are ``selective_log_softmax`` / ``entropy_from_logits`` of those positions,
    zero where the label is -100; without ``fused_lm_head`` the forward is the original one (generation unchanged)."""
    from trl.trainer.utils import FusedCausalLMOutput, entropy_from_logits, selective_log_softmax

    original_forward = model.forward

    @functools.wraps(type(model).forward)
    def _plain_forward(
        self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs
    ):
        if not fused_lm_head:
            extra = dict(labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
            return original_forward(*args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
        if shift_labels is not None:
            raise NotImplementedError("the plain head scores unshifted labels only (no context parallelism)")
        labels = labels[:, 1:]
        mask = labels != -100
        labelled = mask.any(0).nonzero()
        width = labels.shape[1] - int(labelled[0]) if len(labelled) else 1
        kwargs["use_cache"] = False
        logits = original_forward(*args, logits_to_keep=width + 1, **kwargs).logits[:, :-1]  # (B, width, V)
        if cast_lm_head_to_fp32:
            logits = logits.float()
        logits = logits / temperature
        tail_labels, tail_mask = labels[:, -width:], mask[:, -width:]
        tail = selective_log_softmax(logits, tail_labels.clamp(min=0)) * tail_mask
        log_probs = tail.new_zeros(mask.shape)
        log_probs = torch.cat([log_probs[:, : mask.shape[1] - width], tail], dim=1)
        entropy = None
        if "entropy" in outputs:
            ent = entropy_from_logits(logits) * tail_mask
            entropy = torch.cat([ent.new_zeros(mask.shape[0], mask.shape[1] - width), ent], dim=1)
        denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(
            loss=-log_probs.sum() / denominator, log_probs=log_probs, entropy=entropy, label_mask=mask
        )

    model.forward = types.MethodType(_plain_forward, model)


def use_plain_head(impl: str) -> None:
    """Replace ``add_fused_lm_head`` where TRL's trainer module looks it up (GRPOTrainer and RLOOTrainer call it in
    ``__init__`` on the policy and the reference)."""
    import trl.trainer.grpo_trainer as grpo_module
    import trl.trainer.rloo_trainer as rloo_module

    module = grpo_module if impl.startswith("trl_grpo") else rloo_module
    assert hasattr(module, "add_fused_lm_head"), "TRL no longer calls add_fused_lm_head: update the plain head"
    module.add_fused_lm_head = add_plain_lm_head


def check_plain_head(vocab_size: int = 1024, hidden: int = 64, seed: int = 0) -> dict:
    """The plain head against TRL's fused head on one batch (two copies of one model, TRL's label layout: prompt
    columns -100, some completions ending early): log-probs, entropy (relative), a GRPO-like loss and its gradient
    norm, to 1e-5."""
    import copy

    from transformers import LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_ppomax.toyworld.tiny import SPECIALS, WORDS, llama_config, word_level_tokenizer

    words = [*SPECIALS, *WORDS]
    tokenizer = word_level_tokenizer(words + [f"w{i}" for i in range(vocab_size - len(words))])
    torch.manual_seed(seed)
    fused = LlamaForCausalLM(llama_config(tokenizer, hidden_size=hidden, heads=2))
    plain = copy.deepcopy(fused)
    add_fused_lm_head(fused, temperature=1.0, outputs=("log_probs", "entropy"))
    add_plain_lm_head(plain, temperature=1.0, outputs=("log_probs", "entropy"))
    batch, prompt, completion = 6, 7, 12
    ids = torch.randint(4, vocab_size, (batch, prompt + completion))
    attention = torch.ones_like(ids)
    attention[0, :2] = 0  # left padding of a prompt
    attention[1, prompt + 5 :] = 0  # a completion ended early
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, :-completion] = -100
    advantages = torch.randn(batch, 1)
    results = {}
    for name, model in (("fused", fused), ("plain", plain)):
        out = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
        logps, entropy = out.log_probs[:, -completion:], out.entropy[:, -completion:]
        mask = attention[:, -completion:].float()
        loss = -((torch.exp(logps - logps.detach()) * advantages - 0.04 * logps) * mask).sum() / mask.sum()
        model.zero_grad()
        loss.backward()
        grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        results[name] = dict(logps=logps.detach(), entropy=entropy.detach(), loss=loss.item(), grad=grad_norm.item())
    f, p = results["fused"], results["plain"]
    report = {
        "max_abs_logp_difference": (f["logps"] - p["logps"]).abs().max().item(),
        "max_abs_entropy_difference": (f["entropy"] - p["entropy"]).abs().max().item(),
        # entropies reach ln(V) ≈ 12 at V = 151936: float32 sums over the vocabulary agree relatively
        "max_rel_entropy_difference": ((f["entropy"] - p["entropy"]).abs() / f["entropy"].abs().clamp(min=1))
        .max()
        .item(),
        "loss": [f["loss"], p["loss"]],
        "grad_norm": [f["grad"], p["grad"]],
    }
    report["agree_1e-5"] = (
        report["max_abs_logp_difference"] < 1e-5
        and report["max_rel_entropy_difference"] < 1e-5
        and math.isclose(f["loss"], p["loss"], rel_tol=1e-5, abs_tol=1e-6)
        and math.isclose(f["grad"], p["grad"], rel_tol=1e-5, abs_tol=1e-6)
    )
    return report


# --------------------------------------------------------------------------------------------------------------------
# Counting and timing by wrapping public seams

PHASES: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)
#: ``roles``: id of each model (and its submodules) → "policy", "critic" (the rest of ``trainer.model``) or "reference"
#: (frozen models outside it); ``model_depth`` > 0 inside a counted model call.
STATE = {"generating": 0, "model_depth": 0, "roles": {}, "sync": None}


def role(module) -> str:
    return STATE["roles"].get(id(module), "reference")


def assign_roles(trainer, policy) -> None:
    """Roles by identity: the policy's modules, the rest of ``trainer.model`` (a critic), anything else (the frozen
    reference: a model outside ``trainer.model``). Every causal LM alive (``gc``) gets a no-grad timer on its LM head,
    for trainers that run the backbone and the head apart (chunked log-probs): the head's no-grad calls outside a model
    call are scoring forwards too."""
    import gc

    from transformers import PreTrainedModel

    roles = {id(m): "critic" for m in trainer.model.modules()}
    roles.update({id(m): "policy" for m in policy.modules()})
    STATE["roles"] = roles
    for model in [o for o in gc.get_objects() if isinstance(o, PreTrainedModel)]:
        head = model.get_output_embeddings()
        if isinstance(head, torch.nn.Module) and not getattr(head, "_h2h_timed", False):
            head._h2h_timed = True
            head.register_forward_pre_hook(_head_pre_hook)
            head.register_forward_hook(_head_post_hook, always_call=True)


def _head_pre_hook(module, args):
    if STATE["generating"] or STATE["model_depth"] or torch.is_grad_enabled():
        return
    _sync()
    STATE["head_start"] = time.perf_counter()
    COUNTS[f"head_calls/{role(module)}/no_grad"] += 1


def _head_post_hook(module, args, output):
    if STATE.get("head_start") is not None:
        _sync()
        PHASES["scoring_forwards"] += time.perf_counter() - STATE.pop("head_start")


def _sync() -> None:
    if STATE["sync"] is not None:
        STATE["sync"]()


@contextmanager
def timed(phase: str):
    _sync()
    start = time.perf_counter()
    try:
        yield
    finally:
        _sync()
        PHASES[phase] += time.perf_counter() - start


def instrument(pad_token_id: int, eos_token_id: int) -> None:
    """Count and time ``generate`` (calls, rows, generated tokens), every outermost model forward (rows, by model and
    grad mode; the no-grad ones outside ``generate`` timed as scoring forwards) and every optimizer step."""
    from transformers import PreTrainedModel
    from transformers.generation.utils import GenerationMixin

    original_generate = GenerationMixin.generate

    @functools.wraps(original_generate)
    def generate(self, *args, **kwargs):
        if STATE["generating"]:
            return original_generate(self, *args, **kwargs)
        STATE["generating"] += 1
        try:
            with timed("generation"):
                output = original_generate(self, *args, **kwargs)
        finally:
            STATE["generating"] -= 1
        sequences = output if torch.is_tensor(output) else output.sequences
        prompt = kwargs.get("input_ids", args[0] if args else None)
        new = sequences[:, prompt.shape[1] :]
        mask = kwargs.get("attention_mask")
        prompt_tokens = prompt.numel() if mask is None else int(mask.sum())
        COUNTS["prompt_tokens"] += prompt_tokens * (new.shape[0] // prompt.shape[0])  # × num_return_sequences
        COUNTS["generate_calls"] += 1
        COUNTS["generated_rows"] += new.shape[0]
        is_eos = new == eos_token_id
        ended = (is_eos.cumsum(1) - is_eos.long()) > 0  # after the first eos: padding
        COUNTS["generated_columns"] += new.numel()
        COUNTS["generated_tokens"] += int((~ended).sum())  # up to and including the first eos
        COUNTS["completions_ended_by_eos"] += int(is_eos.any(1).sum())
        COUNTS["pad_tokens_sampled"] += int(((new == pad_token_id) & ~ended).sum())
        return output

    GenerationMixin.generate = generate

    original_call = PreTrainedModel.__call__

    def call(module, *args, **kwargs):
        if STATE["generating"] or STATE["model_depth"]:
            return original_call(module, *args, **kwargs)
        ids = kwargs.get("input_ids", args[0] if args else None)
        grad = "grad" if torch.is_grad_enabled() else "no_grad"
        COUNTS[f"forward_rows/{role(module)}/{grad}"] += 0 if ids is None else ids.shape[0]
        COUNTS[f"forward_calls/{role(module)}/{grad}"] += 1
        STATE["model_depth"] += 1
        try:
            if grad == "grad":
                return original_call(module, *args, **kwargs)
            with timed("scoring_forwards"):
                return original_call(module, *args, **kwargs)
        finally:
            STATE["model_depth"] -= 1

    PreTrainedModel.__call__ = call

    steps: dict[int, int] = defaultdict(int)

    def step_hook(optimizer, args, kwargs):
        steps[id(optimizer)] += 1
        COUNTS["optimizer_steps"] = max(steps.values())
        COUNTS["optimizers_stepped"] = len(steps)

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(step_hook)


def timed_reward(function):
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        with timed("reward"):
            scores = function(*args, **kwargs)
        COUNTS["rewarded_completions"] += len(scores)
        return scores

    return wrapped


def peak_memory_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())[1]) * 1024


def causal_lm_in(model):
    """The policy: the (first) causal LM in ``trainer.model`` (TRL's is the model itself; ours is a policy + critic
    module)."""
    return next(m for m in model.modules() if getattr(m, "get_output_embeddings", lambda: None)() is not None)


# --------------------------------------------------------------------------------------------------------------------
# The run


def trainer_for(impl: str, args, policy_folder: str, output_dir: str):
    """The trainer of ``impl`` with the same GRPOConfig-style arguments (one optimizer step per generation batch of
    ``prompts × generations`` completions, ``completion_length`` tokens each, eos and pad never sampled)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_folder)
    completions = args.prompts * args.generations
    micro = min(args.micro_batch, completions)
    if completions % micro:
        raise SystemExit(f"prompts × generations = {completions} must be a multiple of --micro-batch {micro}")
    accumulation = completions // micro
    common = dict(
        output_dir=output_dir,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,  # generation batch = micro × accumulation: one optimizer step per batch
        num_generations=args.generations,
        max_completion_length=args.completion_length,
        num_iterations=1,
        beta=0.04,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        repetition_penalty=1.0,
        # no early stop: eos (and pad, which a random model could sample mid-completion) are never sampled
        generation_kwargs={"suppress_tokens": [tokenizer.eos_token_id, tokenizer.pad_token_id]},
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        gradient_checkpointing=args.gradient_checkpointing,
        bf16=args.bf16,
        use_cpu=args.device == "cpu",
        disable_tqdm=True,
    )
    grpo_objective = dict(loss_type="dapo", scale_rewards="group")
    reward = timed_reward(reward_characters)
    dataset = prompt_dataset(args.prompts * args.steps)
    if impl.startswith("trl_"):
        if impl.endswith("_plain"):
            use_plain_head(impl)
        if impl.startswith("trl_grpo"):
            from trl import GRPOConfig as Config
            from trl import GRPOTrainer as Trainer

            common.update(grpo_objective)
        else:
            from trl import RLOOConfig as Config
            from trl import RLOOTrainer as Trainer
        return Trainer(
            model=policy_folder, reward_funcs=reward, args=Config(**common), train_dataset=dataset
        ), tokenizer
    from trl_ppomax import PPOMaxConfig, PPOMaxTrainer

    estimator = impl.removeprefix("ppomax_")
    ours = dict(common, advantage_estimator=estimator)
    if estimator == "grpo":
        ours.update(grpo_objective)
    if estimator in ("grpo", "rloo"):  # the guide's settings for TRL's objective exactly
        ours.update(reward_norm="none", reward_clip=None)
    else:  # GAE: the critic learns from the first iteration, so that the policy takes as many steps as the others
        ours.update(critic_warmup_steps=0)
    config = PPOMaxConfig(**ours)
    return PPOMaxTrainer(model=policy_folder, reward_funcs=reward, args=config, train_dataset=dataset), tokenizer


def logged_work(log_history: list[dict]) -> dict:
    """What the trainer logged: optimizer-step logs and the mean completion length over them (TRL's metric name,
    which PPOMaxTrainer logs beside its own), the last logged loss and grad norm of the first step."""
    steps = [e for e in log_history if "completions/mean_length" in e]
    lengths = [e["completions/mean_length"] for e in steps]
    first = steps[0] if steps else {}
    return {
        "logged_steps": len(steps),
        "logged_mean_completion_length": sum(lengths) / len(lengths) if lengths else None,
        "logged_num_tokens": steps[-1].get("num_tokens") if steps else None,
        "first_step_loss": first.get("loss"),
        "first_step_grad_norm": first.get("grad_norm"),
        "logged_metric_names": sorted({k for e in steps for k in e}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=IMPLS)
    parser.add_argument("--assets", help="the folder build_assets wrote (built here when missing)")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default max(2, hidden // 64))")
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default 2 × hidden)")
    parser.add_argument("--completion-length", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per generation batch")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt (num_generations)")
    parser.add_argument("--micro-batch", type=int, default=8, help="per_device_train_batch_size (completions)")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps = generation batches")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (TrainingArguments.bf16)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--output-dir", default=None, help="the trainers' output_dir (default: a temp folder)")
    parser.add_argument("--check-plain-head", action="store_true", help="compare the plain head with TRL's fused")
    args = parser.parse_args()
    if args.check_plain_head:
        report = check_plain_head(args.vocab_size, min(args.hidden, 128))  # on the CPU, whatever --device says
        print("RESULT " + json.dumps(report), flush=True)  # the driver fails on a disagreement, after its runs
        return
    if args.impl is None or args.assets is None:
        parser.error("--impl and --assets are required")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        STATE["sync"] = torch.cuda.synchronize
    assets = build_assets(
        args.assets,
        vocab_size=args.vocab_size,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        intermediate=args.intermediate,
    )
    policy_folder = str(assets / "policy")
    import tempfile

    output_dir = args.output_dir or tempfile.mkdtemp(prefix=f"h2h-{args.impl}-")
    trainer, tokenizer = trainer_for(args.impl, args, policy_folder, output_dir)
    instrument(tokenizer.pad_token_id, tokenizer.eos_token_id)
    policy = causal_lm_in(trainer.model)
    assign_roles(trainer, policy)
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    PHASES.clear()
    COUNTS.clear()
    _sync()
    peak_before_train = peak_memory_bytes(args.device)
    start = time.perf_counter()
    trainer.train()
    _sync()
    train_seconds = time.perf_counter() - start
    peak = peak_memory_bytes(args.device)
    changed = [name for name, p in policy.named_parameters() if not torch.equal(before[name], p.detach())]
    assert changed, f"{args.impl}: no policy parameter changed in train()"
    counts = dict(COUNTS)
    phases = {f"{k}_seconds": v for k, v in PHASES.items()}
    for phase in ("generation", "scoring_forwards", "reward"):
        phases.setdefault(f"{phase}_seconds", 0.0)
    phases["update_and_rest_seconds"] = train_seconds - sum(phases.values())
    rows = counts.get("generated_rows", 0)
    result = {
        "impl": args.impl,
        "settings": {k: v for k, v in vars(args).items() if k not in ("impl", "assets", "output_dir")},
        "train_seconds": train_seconds,
        "process_seconds": time.perf_counter() - PROCESS_START,
        **phases,
        "peak_memory_gb": peak / 1e9,
        "peak_memory_before_train_gb": peak_before_train / 1e9,
        "peak_memory_growth_in_train_gb": (peak - peak_before_train) / 1e9,
        "peak_memory_kind": "cuda max_memory_allocated" if args.device == "cuda" else "VmHWM (peak RSS)",
        "global_step": trainer.state.global_step,
        "completions": rows,
        "generated_tokens": counts.get("generated_tokens", 0),
        "mean_completion_length": counts.get("generated_tokens", 0) / rows if rows else None,
        "counts": counts,
        "policy_parameters_changed": len(changed),
        "policy_parameters": sum(1 for _ in policy.parameters()),
        **logged_work(trainer.state.log_history),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
