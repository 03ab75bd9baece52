"""Models: the policy + critic wrapper and how logits, values and scores are read from a model.

A new model family is taught in :func:`backbone_and_head` (body and scalar head of a ``*ForSequenceClassification``).
Sequences are ``[query (left-padded, width L) | response (right-padded, width T)]``; the logits and value for
response token ``t`` are read at position ``L − 1 + t``, the score where the model reads it (:func:`score_position`)."""

from __future__ import annotations

import copy
import inspect
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import PreTrainedModel
from transformers.trainer_utils import load_sharded_checkpoint
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
from trl.trainer.utils import disable_dropout_in_model

from trl_ppomax.base import compat, core
from trl_ppomax.data.files import ADAPTER_WEIGHTS

logger = logging.getLogger(__name__)

#: Attribute names of the scalar head of a sequence-classification model, in the order they are tried.
SCORE_HEAD_NAMES = ("score", "classifier")


class PolicyAndCritic(nn.Module):
    """Policy and critic behind one ``forward`` so that one ``accelerator.prepare`` (DDP, DeepSpeed) wraps both:
    it returns the policy's log-probs of the responses (computed from its last hidden states in chunks, the whole
    (B, T, V) logits never held), the values (B, T; None without a critic) and the policy's log-probs on
    ``ptx_inputs`` when given. trl 1.12's names ``policy`` and ``value_model`` both work."""

    def __init__(self, policy: nn.Module, critic: nn.Module | None) -> None:
        super().__init__()
        self.policy, self.critic = policy, critic  # critic: None with a critic-free advantage estimator

    @property
    def trained(self) -> list[nn.Module]:
        """The policy, and the critic when there is one."""
        return [self.policy] + ([self.critic] if self.critic is not None else [])

    @property
    def _no_split_modules(self) -> list[str]:
        """The policy's and the critic's layer classes: FSDP's transformer auto-wrap shards layer by layer."""
        return list(dict.fromkeys(n for m in self.trained for n in getattr(_base(m), "_no_split_modules", None) or []))

    @property
    def value_model(self) -> nn.Module:
        """The critic, under trl 1.12's name (``trainer.model.value_model``)."""
        return self.critic

    def generate(self, *args, **kwargs):
        """The policy's ``generate`` (``trainer.model.generate``, as TRL GRPO's trainer model has it): rollouts call
        it here, so a test patching ``trainer.model.generate`` scripts them."""
        return self.policy.generate(*args, **kwargs)

    def forward(self, inputs: dict, responses: torch.Tensor, ptx_inputs: dict | None = None, **logprob_options):
        """``(log-probs, entropy, values, ptx log-probs)``: the policy's :func:`response_logprobs` of ``responses``
        (B, T) with ``logprob_options``, the critic's values (B, T; None without one) and the log-probs of the next
        tokens of ``ptx_inputs`` (B, L − 1; None without)."""
        logprobs, entropy = response_logprobs(self.policy, inputs, responses, **logprob_options)
        width = responses.shape[1]
        values = token_values(self.critic, inputs, width) if self.critic is not None else None
        ptx = None
        if ptx_inputs is not None:
            chunk_size = chunk_positions(logprob_options.get("chunk_size"), self.policy)
            ptx = core.token_logprobs(*next_token_features(self.policy, ptx_inputs), chunk_size=chunk_size)[0]
        return logprobs, entropy, values, ptx

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        kwargs = gradient_checkpointing_kwargs or {"use_reentrant": False}
        for model in self.trained:
            new = hasattr(type(model), "activation_checkpointing_enable")  # transformers ≥ 5.x name
            (model.activation_checkpointing_enable if new else model.gradient_checkpointing_enable)(kwargs)

    @property
    def is_gradient_checkpointing(self) -> bool:
        new = hasattr(type(self.policy), "is_activation_checkpointing")
        return bool(getattr(self.policy, "is_activation_checkpointing" if new else "is_gradient_checkpointing", False))

    def gradient_checkpointing_disable(self) -> None:
        for model in self.trained:
            new = hasattr(type(model), "activation_checkpointing_disable")
            (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()


def without_zero3_init():
    """A context in which transformers builds whole models (``from_config``) even under DeepSpeed ZeRO-3, not
    partitioned inside ``zero.Init``: for a model one process builds and writes (the tiny models), or a shell whose
    parameters are all replaced (``with_lm_head``)."""
    from transformers import modeling_utils

    return getattr(modeling_utils, "set_zero3_state", nullcontext)()  # marks zero.Init as already entered


def _base(model: nn.Module) -> nn.Module:
    """``model`` without its PEFT wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def response_logits(model: nn.Module, inputs: dict[str, torch.Tensor], response_width: int) -> torch.Tensor:
    """Logits (B, T, V) predicting each response token: positions ``L − 1 … L + T − 2`` (only the last ``T + 1``
    asked for, ``logits_to_keep``, when the model supports it)."""
    extra = {"logits_to_keep": response_width + 1} if takes_logits_to_keep(model) else {}
    logits = model(**inputs, use_cache=False, **extra).logits
    return logits[:, -response_width - 1 : -1]


#: Config fields of a causal LM whose logits are more than ``lm_head(last hidden state)`` (a scale, a soft cap): its
#: log-probs come from its own logits, whole (TRL's ``add_fused_lm_head`` reads the same fields).
LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_scaling",
)


def plain_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """``(backbone, lm_head)`` of a causal LM (PEFT-wrapped or not) whose logits are ``lm_head(backbone(...)
    .last_hidden_state)``, or None (no such parts, a logit transform of :data:`LOGIT_TRANSFORMS`, a PEFT prompt
    adapter, a head sharded by FSDP2)."""
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and peft_config.is_prompt_learning:
        return None
    base = _base(model)
    config = getattr(base, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text_config is None or any(getattr(text_config, name, None) is not None for name in LOGIT_TRANSFORMS):
        return None
    backbone = getattr(base, getattr(base, "base_model_prefix", ""), None)
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if not (isinstance(backbone, nn.Module) and isinstance(head, nn.Module)) or sharded_outside_forward(head):
        return None
    return backbone, head


def sharded_outside_forward(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are DTensor shards (FSDP2, tensor parallelism), whole only inside the forward
    of the unit that owns them: its log-probs then come from the model's own logits."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(parameter, DTensor) for parameter in module.parameters())


def response_features(model: nn.Module, inputs: dict[str, torch.Tensor], response_width: int):
    """``(features (B, T, F), head)`` with ``head(features)`` the logits predicting each response token (positions
    ``L − 1 … L + T − 2``): the last hidden states and the LM head when the model has a :func:`plain_head`, else the
    logits themselves (:func:`response_logits`) and the identity."""
    parts = plain_head(model)
    if parts is None:
        return response_logits(model, inputs, response_width), nn.Identity()
    backbone, head = parts
    return last_hidden_state(model, backbone, inputs)[:, -response_width - 1 : -1], head


def next_token_features(model: nn.Module, inputs: dict[str, torch.Tensor]):
    """``(features (B, L − 1, F), head, next tokens (B, L − 1))`` of a language-modelling batch (PPO-ptx): as
    :func:`response_features`, every position predicting the next input token."""
    parts = plain_head(model)
    if parts is None:
        features, head = model(**inputs, use_cache=False).logits, nn.Identity()
    else:
        features, head = last_hidden_state(model, parts[0], inputs), parts[1]
    return features[:, :-1], head, inputs["input_ids"][:, 1:]


def last_hidden_state(model: nn.Module, backbone: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The ``backbone``'s last hidden states (B, S, H), read by a forward hook while ``model`` runs its own forward
    (so that what wraps it runs as usual: FSDP2 gathers, PEFT adapters), the logits asked for at one position only
    (``logits_to_keep``, where the model takes it)."""
    captured = []
    handle = backbone.register_forward_hook(lambda module, args, output: captured.append(output[0]))
    try:
        model(**inputs, use_cache=False, **({"logits_to_keep": 1} if takes_logits_to_keep(model) else {}))
    finally:
        handle.remove()
    return captured[-1]


def takes_logits_to_keep(model: nn.Module) -> bool:
    """Whether the causal LM inside ``model`` (PEFT-wrapped or not) computes only the last ``logits_to_keep``
    positions' logits."""
    return "logits_to_keep" in inspect.signature(_base(model).forward).parameters


#: Under autograd ``logprob_chunk_size`` counts positions at this vocabulary (Qwen's): a smaller one takes
#: proportionally more.
CHUNK_VOCABULARY = 151_936


def chunk_positions(chunk_size: int | None, model: nn.Module) -> int | None:
    """Positions per pass through ``model``'s LM head under autograd: ``logprob_chunk_size`` at a vocabulary of
    151,936, and in proportion more for a smaller one, so that a chunk's logits stay the same size (128 × 151,936
    float32, 74 MiB, by default) and few chunks are recomputed in backward. Without autograd nothing is recomputed
    and a chunk more costs a loop step only: ``logprob_chunk_size`` at any vocabulary. None: off."""
    if chunk_size is None or not torch.is_grad_enabled():
        return chunk_size
    vocabulary = embedding_size(model) or CHUNK_VOCABULARY
    return max(chunk_size, chunk_size * CHUNK_VOCABULARY // vocabulary)


def logprob_options(args) -> dict:
    """How the update and the scoring forwards compute log-probs: at the log-prob temperature, ``logprob_chunk_size``
    positions through the LM head at a time."""
    return dict(temperature=args.effective_logprob_temperature, chunk_size=args.logprob_chunk_size)


def response_logprobs(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    responses: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, T) of ``responses`` under ``model`` at ``temperature``, and the entropy (B, T) with ``entropy``:
    :func:`~trl_ppomax.base.core.token_logprobs` of :func:`response_features`, ``chunk_size`` positions through the
    head at a time (None: all at once)."""
    features, head = response_features(model, inputs, responses.shape[1])
    chunk_size = chunk_positions(chunk_size, model)
    options = dict(temperature=temperature, chunk_size=chunk_size, entropy=entropy, entropy_grad=entropy_grad)
    return core.token_logprobs(features, head, responses, **options)


def score_head(model: nn.Module) -> nn.Module | None:
    """The scalar head of a ``*ForSequenceClassification`` model (PEFT-wrapped or not), or None."""
    heads = (getattr(_base(model), name, None) for name in SCORE_HEAD_NAMES)
    return next((head for head in heads if head is not None), None)


def backbone_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The transformer body and the scalar head of a ``*ForSequenceClassification`` model."""
    base = _base(model)
    backbone = getattr(base, getattr(base, "base_model_prefix", ""), None)
    head = score_head(model)
    if backbone is None or head is None:
        raise ValueError(
            f"{type(model).__name__} is not a sequence-classification model with a `score` head; load reward and "
            "value models with AutoModelForSequenceClassification.from_pretrained(..., num_labels=1)."
        )
    return backbone, head


def token_values(model: nn.Module, inputs: dict[str, torch.Tensor], response_width: int) -> torch.Tensor:
    """Per-token values (B, T) of a sequence-classification critic: its head applied at every position."""
    backbone, head = backbone_and_head(model)
    hidden = backbone(**inputs, use_cache=False).last_hidden_state[:, -response_width - 1 : -1]
    return head(hidden).squeeze(-1).float()


def score_position(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Index (B,) of the token a ``*ForSequenceClassification`` ``model`` reads its score at, by the model's rule:
    the rightmost position whose id is not ``config.pad_token_id``: with a dedicated pad token the last real token,
    with ``pad == eos`` (trl's default without a pad, e.g. LLaMA) the token *before* trailing eos(s), as trl's
    ``RewardTrainer`` trains it. Positions with ``attention_mask == 0`` are skipped too; without a pad id in the
    config, the last attended position. A row with no readable token gives 0, as transformers does."""
    config = getattr(_base(model), "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    pad_id = getattr(config, "pad_token_id", None)
    readable = torch.ones_like(input_ids, dtype=torch.bool) if pad_id is None else input_ids != pad_id
    if attention_mask is not None:
        readable = readable & attention_mask.bool()
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    return (positions * readable).argmax(-1)


def sequence_scores(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Reward-model score (B,) of query ⊕ response ``inputs``, read where the model itself reads it
    (:func:`score_position`): the same token as ``model(**inputs).logits`` and the reward trainer, in every padding."""
    backbone, head = backbone_and_head(model)
    hidden = backbone(**inputs, use_cache=False).last_hidden_state
    last = score_position(model, inputs["input_ids"], inputs.get("attention_mask"))
    picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    return head(picked).squeeze(-1).float()


# -- Building the trained and frozen models from the trainer's arguments -----------------------------------------------
def is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def policy_and_reference(
    model: nn.Module, ref_model: nn.Module | None, peft_config
) -> tuple[nn.Module, nn.Module | None]:
    """The policy (wrapped with ``peft_config`` if given) and the frozen reference: ``ref_model``, a copy of the
    policy, or ``None`` for a PEFT policy (whose reference is the policy with its adapter disabled)."""
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    if is_peft(model):
        return model, None
    return model, ref_model if ref_model is not None else copy.deepcopy(model).eval().requires_grad_(False)


def critic_from(value_model: nn.Module | None, reward_model) -> nn.Module:
    """``value_model``, or a trainable copy of the reward model (critic initialised from the reward model, §5.3.3;
    :meth:`~trl_ppomax.rewards.RewardSources.critic_source` chose one that reads the policy's tokens)."""
    return value_model if value_model is not None else copy.deepcopy(reward_model).requires_grad_(True)


def critic_from_policy(policy: nn.Module) -> nn.Module:
    """A critic initialised from the policy (verl's and OpenRLHF's default): its architecture as a
    ``*ForSequenceClassification`` with one label, the policy's backbone weights (a PEFT policy's adapter merged into
    a copy), a fresh scalar head (zeros: V = 0 until the critic warm-up fits it). One more copy of the policy's
    weights, trained with its own Adam states."""
    from transformers import AutoModelForSequenceClassification

    base = copy.deepcopy(policy).merge_and_unload() if is_peft(policy) else policy
    config = copy.deepcopy(base.config)
    config.num_labels, config.problem_type = 1, None
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = getattr(base.generation_config, "pad_token_id", None) or config.eos_token_id
    try:
        critic = AutoModelForSequenceClassification.from_config(config, dtype=base.dtype)
    except ValueError as error:
        raise ValueError(
            f"No critic can be built from the policy ({type(base).__name__}: {error}); pass value_model= (an "
            "AutoModelForSequenceClassification with num_labels=1) or a reward model."
        ) from error
    missing, _ = critic.load_state_dict(base.state_dict(), strict=False)
    head = [key for key in missing if key.split(".")[0] in SCORE_HEAD_NAMES]
    if len(head) != len(missing):
        raise ValueError(
            f"The policy's weights do not fit {type(critic).__name__}'s backbone ({len(missing) - len(head)} missing, "
            f"e.g. {sorted(set(missing) - set(head))[0]}); pass value_model= (a critic with num_labels=1)."
        )
    for name in head:
        nn.init.zeros_(critic.get_parameter(name))
    logger.info("The critic is the policy with a fresh scalar head (%s): no reward model to initialise it from.", head)
    return critic.requires_grad_(True)


def warn_new_value_head(folder: str, missing_keys) -> None:
    """After ``value_model=folder`` was loaded with ``AutoModelForSequenceClassification``: warn when ``from_pretrained``
    left the scalar head newly initialised (its weights, :data:`SCORE_HEAD_NAMES`, among ``missing_keys``), as for a
    policy (causal LM) folder. A warning, not an error: starting the critic from the SFT policy can be deliberate."""
    new = sorted(key for key in missing_keys if key.split(".")[0] in SCORE_HEAD_NAMES)
    if new:
        logger.warning(
            "value_model=%r holds no value head (%s newly initialised, random): it looks like a policy (causal LM) "
            "folder, not a reward model. The paper initialises the critic from the reward model (§5.3.3): pass "
            "value_model=None to copy the reward model, or the reward model's folder. If starting the critic from the "
            "policy is deliberate, warm the random head up first (critic_warmup_steps).",
            folder,
            ", ".join(new),
        )


def check_single_label(model) -> None:
    """Reward and value models must output one score."""
    config = getattr(model, "config", None)
    if isinstance(model, nn.Module) and config is not None and getattr(config, "num_labels", 1) != 1:
        raise ValueError(
            f"Reward and value models must output one score (num_labels=1); {type(model).__name__} has "
            f"num_labels={config.num_labels}. Load it with num_labels=1."
        )


def build_models(args, model, ref_model, reward_model, value_model, peft_config) -> tuple[nn.Module, ...]:
    """``(policy, reference, critic)`` from the trainer's arguments (checked by
    :func:`~trl_ppomax.ppo.checks.check_model_arguments`), dropout off everywhere (PPO's ratio must start at 1). The
    critic: ``value_model``, else a copy of ``reward_model`` (the reward model it is initialised from), else, with
    reward functions or an environment only, the policy with a fresh scalar head; none for a critic-free
    advantage estimator."""
    policy, reference = policy_and_reference(model, ref_model, peft_config)
    if is_peft(policy) and args.model_adapter_name:
        policy.set_adapter(args.model_adapter_name)
    critic = None
    if args.uses_critic:
        critic = critic_from(value_model, reward_model) if reward_model is not None else critic_from_policy(policy)
    for module in (m for m in (policy, critic, reference, reward_model) if isinstance(m, nn.Module)):
        disable_dropout_in_model(module)
    for scorer in (reward_model, critic):
        check_single_label(scorer)
    if args.use_liger_kernel:
        apply_liger_kernels(args, policy, reference, critic)
    return policy, reference, critic


def apply_liger_kernels(args, *modules: nn.Module | None) -> None:
    """``use_liger_kernel``: Liger's layer kernels (RMSNorm, SwiGLU, RoPE; ``liger_kernel_config``) patched into each
    model, as TRL's trainers do; its fused linear cross-entropy stays off, since the log-probs never go through the
    model's ``forward`` (:func:`response_features`). transformers' ``apply_liger_kernel`` raises, naming the
    package, when ``liger-kernel`` is not installed."""
    from transformers.integrations.liger import apply_liger_kernel

    config = {**(args.liger_kernel_config or {}), "fused_linear_cross_entropy": False}
    for module in (m for m in modules if m is not None):
        apply_liger_kernel(module, config)


def prepare_frozen(module: nn.Module, accelerator) -> nn.Module:
    """A reference or reward model for inference only: frozen, and sharded under DeepSpeed ZeRO-3 or FSDP as the
    trained models are (trl's ``prepare_deepspeed`` / ``prepare_fsdp``), else moved to the device."""
    from accelerate.utils import DistributedType
    from trl.models.utils import prepare_deepspeed, prepare_fsdp

    module.eval().requires_grad_(False)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return prepare_deepspeed(module, accelerator)
    if accelerator.distributed_type == DistributedType.FSDP:
        return prepare_fsdp(module, accelerator)
    return module.to(accelerator.device)


@contextmanager
def policy_for_generation(model: nn.Module, accelerator, args) -> Iterator[PolicyAndCritic]:
    """The unwrapped :class:`PolicyAndCritic` ready for generation (trl's ``unwrap_model_for_generation``), but under
    DeepSpeed ZeRO-3 with ``ds3_gather_for_generation`` only the **policy's** parameters are gathered: the critic, as
    large as the policy, stays sharded (use only ``.policy`` inside the block)."""
    from trl.models.utils import add_hooks, remove_hooks, unwrap_model_for_generation

    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    gather, checkpointing_kwargs = args.ds3_gather_for_generation, args.checkpointing[1]
    if not (plugin is not None and plugin.zero_stage == 3 and gather):
        with unwrap_model_for_generation(
            model, accelerator, gather, gradient_checkpointing_kwargs=checkpointing_kwargs
        ) as w:
            yield w
        return
    import deepspeed

    wrapper = accelerator.unwrap_model(model)
    checkpointing = wrapper.is_gradient_checkpointing
    if checkpointing:
        wrapper.gradient_checkpointing_disable()
    with deepspeed.zero.GatheredParameters(list(wrapper.policy.parameters())):
        remove_hooks(model)  # the engine's fetch/release hooks would re-partition the gathered policy
        try:
            yield wrapper
        finally:
            add_hooks(model)
    if checkpointing:
        wrapper.gradient_checkpointing_enable(checkpointing_kwargs)


@contextmanager
def reference_policy(ref_model: nn.Module | None, policy: nn.Module, ref_adapter_name: str | None):
    """The reference model, or, for a PEFT policy, the policy with its adapter disabled (or switched to
    ``ref_adapter_name``, the active adapter restored afterwards: trl's ``use_adapter``)."""
    if ref_model is not None:
        yield ref_model
        return
    from trl.trainer.utils import use_adapter

    with use_adapter(policy, ref_adapter_name):
        yield policy


@contextmanager
def fsdp_unsharded(*models: nn.Module) -> Iterator[None]:
    """Under FSDP2, the root units of ``models`` gathered (embeddings, final norm, heads) so that submodules can be
    called on their own (``policy.generate``, a backbone and its score head). A no-op otherwise."""
    from torch.distributed.fsdp import FSDPModule

    roots = [model for model in models if isinstance(model, FSDPModule)]
    for root in roots:
        compat.fsdp_lazy_init(root)  # what the root's first forward would do (a no-op after it)
        root.unshard()
    try:
        yield
    finally:
        for root in roots:
            root.reshard()


# -- Weights from a saved folder, and what identifies a run's models ---------------------------------------------------
def sub_state_dict(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Entries of ``state`` under ``prefix`` (e.g. ``"policy."``), with the prefix removed."""
    return {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}


def load_weights(module: nn.Module, folder: str | os.PathLike) -> None:
    """Load the weights ``save_pretrained`` wrote in ``folder`` (one safetensors file, a sharded index, or a PEFT
    adapter) into ``module``; tied weights may be absent, anything else missing or unexpected is an error."""
    folder = Path(folder)
    if (folder / ADAPTER_WEIGHTS).exists():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(module, load_file(folder / ADAPTER_WEIGHTS))
        return
    sharded = (folder / SAFE_WEIGHTS_INDEX_NAME).exists()
    if not sharded and not (folder / SAFE_WEIGHTS_NAME).exists():
        raise FileNotFoundError(f"No {SAFE_WEIGHTS_NAME} in {folder}; is it a trl-ppomax checkpoint?")
    if isinstance(module, PreTrainedModel):
        # through from_pretrained, which maps the saved names back (e.g. GPT-NeoX saves its head as embed_out), with
        # the module's own config: a missing or foreign config.json must not build another model (a default 7B Llama)
        loaded, info = type(module).from_pretrained(
            folder, config=module.config, dtype=next(module.parameters()).dtype, output_loading_info=True
        )
        mismatched = [key for key, *_ in info.get("mismatched_keys", [])]  # left at from_pretrained's random init
        _check_weights_fit(module, folder, [*info["missing_keys"], *mismatched], list(info["unexpected_keys"]))
        module.load_state_dict(loaded.state_dict())
        return
    if sharded:
        missing, unexpected = load_sharded_checkpoint(module, folder, strict=False)  # one shard in memory at a time
    else:
        missing, unexpected = module.load_state_dict(load_file(folder / SAFE_WEIGHTS_NAME), strict=False)
    _check_weights_fit(module, folder, missing, unexpected)


def _check_weights_fit(module: nn.Module, folder: Path, missing: list[str], unexpected: list[str]) -> None:
    """Tied weights may be absent from a saved folder; any other missing or unexpected weight is an error."""
    tied = set(getattr(module, "all_tied_weights_keys", None) or getattr(module, "_tied_weights_keys", None) or [])
    missing = [key for key in missing if key not in tied]
    if missing or unexpected:
        raise ValueError(
            f"The weights in {folder} do not match {type(module).__name__}: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}. Resume with the same model architecture the checkpoint was written with."
        )


def _parameter_count(module: nn.Module) -> int:
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())  # ZeRO-3 partitions report ds_numel


def model_identity(wrapper) -> dict:
    """What identifies the models of a run: the policy's ``_name_or_path`` and the parameter counts of policy and
    critic (counted before ``accelerator.prepare`` shards them)."""
    config = getattr(wrapper.policy, "config", None)
    return {
        "policy": getattr(config, "_name_or_path", None) or None,
        "policy_parameters": _parameter_count(wrapper.policy),
        "critic_parameters": _parameter_count(wrapper.critic) if wrapper.critic is not None else 0,
    }


def sequence_inputs(
    query_ids: torch.Tensor, query_mask: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask``, ``position_ids`` (B, L + T) of query ⊕ response (positions: real tokens)."""
    attention_mask = torch.cat([query_mask, response_mask.to(query_mask.dtype)], dim=1)
    return {
        "input_ids": torch.cat([query_ids, response_ids], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0),
    }


def embedding_size(model) -> int | None:
    """Rows of ``model``'s input embedding (the ids it can read), or its config's ``vocab_size``; None if unknown."""
    if not isinstance(model, nn.Module):
        return None
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embeddings = None
    size = getattr(embeddings, "num_embeddings", None)  # kept under ZeRO-3, where the weight is a placeholder
    if size is None and getattr(embeddings, "weight", None) is not None and embeddings.weight.ndim == 2:
        size = embeddings.weight.shape[0]
    if size is None:
        config = getattr(model, "config", None)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        size = getattr(config, "vocab_size", None)
    return int(size) if size is not None else None
