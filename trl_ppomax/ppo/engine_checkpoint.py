"""Engine-only saves: DeepSpeed ZeRO-3 without ``stage3_gather_16bit_weights_on_model_save``, where the full weights
are never gathered (as in transformers' ``Trainer``). ``checkpoint-N`` and ``save_model`` folders then hold the
engine's sharded checkpoint (``latest``, ``global_step*/``, ``zero_to_fp32.py``), the configs and the tokenizer, but
no plain weights; :func:`consolidate_engine_checkpoint` (``trl-ppomax consolidate``) turns such a folder into plain
transformers folders: the policy at the top, the critic in ``critic/`` (a checkpoint) or ``value_model/`` (a
``save_model`` folder, which ``AutoModelForSequenceClassification`` loads and ``value_model=`` warm-starts a run from).

Only consolidating needs DeepSpeed installed; everything else here reads folders and writes configs.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
from pathlib import Path

import torch

from trl_ppomax.data.files import CRITIC_DIR, VALUE_MODEL_DIR, atomic_directory
from trl_ppomax.models import is_peft, sub_state_dict

logger = logging.getLogger(__name__)

#: The line a DeepSpeed JSON needs for ZeRO-3 to save plain model folders.
GATHER_ON_SAVE = '"stage3_gather_16bit_weights_on_model_save": true'
#: What to install where consolidating needs DeepSpeed.
INSTALL_DEEPSPEED = 'pip install "trl-ppomax[deepspeed]"'
#: The critic's subfolders a consolidation fills: ``critic/`` of a checkpoint, ``value_model/`` of ``save_model``.
CRITIC_FOLDERS = (CRITIC_DIR, VALUE_MODEL_DIR)


def saves_engine_checkpoint_only(engine) -> bool:
    """Whether the DeepSpeed ``engine`` saves its sharded checkpoint instead of plain weights: ZeRO-3 without
    ``stage3_gather_16bit_weights_on_model_save`` (accelerate's ``get_state_dict`` refuses to gather then)."""
    return engine.zero_optimization_stage() == 3 and not engine.zero_gather_16bit_weights_on_model_save()


def engine_checkpoint_advice(folder: str) -> str:
    """How to consolidate the engine checkpoint in ``folder`` and save plain folders next time (ends the warnings)."""
    return (
        "To get plain transformers folders (the policy at the top, the critic in critic/ or value_model/ when the "
        f"folder has one): `trl-ppomax consolidate {folder}`, or consolidate_engine_checkpoint('{folder}') from "
        "trl_ppomax.ppo.engine_checkpoint (on CPU, no GPU needed; it needs memory for the fp32 weights and "
        f"{INSTALL_DEEPSPEED}). DeepSpeed's own converters work too, "
        f"`python {os.path.join(folder, 'zero_to_fp32.py')} {folder} OUT` or "
        f"deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict('{folder}', 'OUT'): their state "
        "dict holds the policy's weights under the prefix `policy.` and the critic's under `critic.` (strip it before "
        f'load_state_dict). To save plain folders directly, add {GATHER_ON_SAVE} under "zero_optimization" in the '
        "DeepSpeed JSON (or `zero3_save_16bit_model: true` in the accelerate config): save_model then gathers the full "
        "weights on the main process."
    )


def warn_at_start() -> None:
    """Said once before the first rollout of a run that saves engine checkpoints only."""
    logger.warning(
        "DeepSpeed ZeRO-3 with stage3_gather_16bit_weights_on_model_save false (your DeepSpeed config does not "
        "set it): the full weights are never gathered, so every checkpoint-N and save_model will hold "
        "DeepSpeed's sharded engine checkpoint (global_step*/, weights and optimizer states) with the configs "
        "and the tokenizer, but no plain model weights. Resuming under DeepSpeed works as usual. %s",
        engine_checkpoint_advice("FOLDER"),
    )


def warn_saved(folder: str | os.PathLike) -> None:
    """After an engine-only ``save_model`` into ``folder``: drop its earlier engine folders and say how to
    consolidate it."""
    tag = drop_older_engine_folders(folder)
    logger.warning(
        "save_model: %s holds DeepSpeed's sharded engine checkpoint (%s/, with the optimizer states), the "
        "policy's config and the tokenizer, but no plain model weights: under ZeRO-3 with "
        "stage3_gather_16bit_weights_on_model_save false the full weights are not gathered. %s",
        folder,
        tag,
        engine_checkpoint_advice(str(folder)),
    )


def warn_not_pushed(output_dir: str, repo: str | None) -> None:
    """``push_to_hub`` of an engine-only ``output_dir``: nothing is uploaded; how to consolidate and push it."""
    logger.warning(
        "push_to_hub: not pushing %s to %s: it holds a sharded DeepSpeed engine checkpoint, not a model that "
        "from_pretrained loads (ZeRO-3 with stage3_gather_16bit_weights_on_model_save false). Consolidate it "
        "(see the save_model warning above), then push the plain folder with `trl-ppomax push %s --repo-id %s`.",
        output_dir,
        repo,
        output_dir,
        repo,
    )


def warn_no_model_push(repo: str | None, with_checkpoint: bool) -> None:
    """A push during training leaves the model out (the checkpoint folders go with ``with_checkpoint``)."""
    logger.warning(
        "push_to_hub: the checkpoints hold sharded DeepSpeed engine checkpoints, no plain model (ZeRO-3 with "
        "stage3_gather_16bit_weights_on_model_save false): no model is pushed to %s during training%s. %s",
        repo,
        "; the checkpoint folders are (hub_strategy)" if with_checkpoint else "",
        engine_checkpoint_advice("CHECKPOINT"),
    )


# -- Writing --------------------------------------------------------------------------------------------------------
def save_configs(wrapper, folder: str, critic_dir: str | None, tokenizer) -> None:
    """What an engine-only save writes besides the engine checkpoint (main process): the policy's and, in
    ``folder/critic_dir``, the critic's configs (:func:`save_config`); ``value_model/`` gets the tokenizer too, as a
    model of its own."""
    save_config(wrapper.policy, folder)
    if critic_dir and wrapper.critic is not None:
        save_config(wrapper.critic, os.path.join(folder, critic_dir))
        if critic_dir == VALUE_MODEL_DIR:
            tokenizer.save_pretrained(os.path.join(folder, critic_dir))


def save_config(model, folder: str) -> None:
    """What ``save_pretrained`` writes besides the weights: the config (with ``architectures``, as it sets them) and
    the generation config, or a PEFT model's adapter config."""
    os.makedirs(folder, exist_ok=True)
    if is_peft(model):
        model.peft_config[model.active_adapter].save_pretrained(folder)
        return
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(folder)


def drop_older_engine_folders(folder: str | os.PathLike) -> str | None:
    """Remove the ``global_step*`` folders of earlier engine-only saves into ``folder`` (``save_model`` merges into
    it); keep the one DeepSpeed's ``latest`` names, returned."""
    folder = Path(folder)
    latest = folder / "latest"
    tag = latest.read_text().strip() if latest.is_file() else None
    for old in folder.glob("global_step*"):
        if tag and old.name != tag and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return tag


# -- Consolidating --------------------------------------------------------------------------------------------------
def check_engine_folder(folder: str | os.PathLike) -> Path:
    """``folder`` as a ``Path`` once it is seen to hold an engine checkpoint of a trl-ppomax run (a policy
    ``config.json`` and DeepSpeed's ``latest``); a ``ValueError`` naming what is missing else. Needs no DeepSpeed."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} does not exist: pass a checkpoint-N or save_model folder of the run.")
    if not (folder / "config.json").is_file():
        advice = (
            " (a PEFT policy: consolidate with DeepSpeed's get_fp32_state_dict_from_zero_checkpoint and load the "
            "`policy.` entries into the PEFT model)"
            if (folder / "adapter_config.json").is_file()
            else ": pass a checkpoint-N or save_model folder of a trl-ppomax run"
        )
        raise ValueError(f"{folder} has no config.json{advice}.")
    if not (folder / "latest").is_file():
        plain = any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))
        raise ValueError(
            f"{folder} holds no DeepSpeed engine checkpoint (no `latest` file beside a global_step*/), so there is "
            "nothing to consolidate" + (": its weights are already plain, from_pretrained loads it." if plain else ".")
        )
    return folder


def fp32_state_dict(folder: Path) -> dict:
    """DeepSpeed's ``zero_to_fp32`` state dict of ``folder``'s engine checkpoint, each tensor read on demand; an
    ``ImportError`` naming the extra to install when DeepSpeed is missing."""
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as error:
        raise ImportError(
            f"consolidating the engine checkpoint in {folder} needs DeepSpeed, which is not installed: "
            f"{INSTALL_DEEPSPEED}"
        ) from error
    return get_fp32_state_dict_from_zero_checkpoint(str(folder), lazy_mode=True)


def consolidate_engine_checkpoint(folder: str | os.PathLike, output_dir: str | os.PathLike | None = None) -> Path:
    """Turn a ``checkpoint-N`` or ``save_model`` folder holding only a sharded DeepSpeed engine checkpoint into plain
    transformers folders: the policy and tokenizer at the top of ``output_dir`` (default: ``folder``), the critic in
    ``critic/`` and/or ``value_model/`` (with the tokenizer) as ``folder`` has them. Runs on CPU, in one process, with
    DeepSpeed's ``zero_to_fp32`` (fp32 master weights: it needs memory for them; ``pip install
    "trl-ppomax[deepspeed]"``). Returns ``output_dir``, which ``from_pretrained`` loads."""
    import transformers

    folder = check_engine_folder(folder)
    output = Path(output_dir) if output_dir is not None else folder
    state = fp32_state_dict(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    parts = [("policy.", folder, output, transformers.AutoModelForCausalLM)]
    for name in CRITIC_FOLDERS:
        if (folder / name / "config.json").is_file():
            parts.append(("critic.", folder / name, output / name, transformers.AutoModelForSequenceClassification))
    for prefix, source, target, auto in parts:
        model = _model_from(state, prefix, source, auto, folder)
        with atomic_directory(target, merge=True) as temporary:
            model.save_pretrained(temporary)
            if target == output or target.name == VALUE_MODEL_DIR:  # a model of its own: with its tokenizer
                tokenizer.save_pretrained(temporary)
        del model
    return output


def _model_from(state: dict, prefix: str, source: Path, auto, folder: Path):
    """The model of ``source/config.json`` holding the ``prefix`` entries of ``state`` (built on the meta device,
    the tensors assigned); a ``ValueError`` when they do not fit it."""
    import transformers

    weights = {name: tensor.contiguous() for name, tensor in sub_state_dict(state, prefix).items()}
    config = transformers.AutoConfig.from_pretrained(source)
    names = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, names[0], None) if names else None
    with torch.device("meta"):
        model = auto.from_config(config) if model_class is None else model_class(config)
    _, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing or unexpected:
        raise ValueError(
            f"The engine checkpoint of {folder} does not fit {source / 'config.json'}: missing {missing[:5]}, "
            f"unexpected {list(unexpected)[:5]}."
        )
    return model
