"""The training commands behind ``trl-ppomax ppo`` and ``trl-ppomax reward`` (as trl ships ``trl/scripts``).

``recipes/ppo_max.py`` and ``recipes/reward_modeling.py`` in the repository are thin wrappers around these modules.
This module imports nothing heavy: the command line uses it to find the shipped configs.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]
CONFIGS_DIR = PACKAGE_DIR / "configs"
ACCELERATE_CONFIGS_DIR = PACKAGE_DIR / "accelerate_configs"

# --accelerate_config short names (as trl's), besides the shipped file names without ".yaml"
ACCELERATE_ALIASES = {
    "zero2": "deepspeed_zero2",
    "zero3": "deepspeed_zero3",
    "fsdp2": "fsdp",
    "fsdp": "fsdp",
    "multi_gpu": "multi_gpu",
    "single_gpu": "single_gpu",
}


def shipped_configs() -> list[str]:
    """Names of the training configs shipped with the package (``--config NAME``)."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


def shipped_accelerate_configs() -> list[str]:
    """Names accepted by ``--accelerate_config``: the short aliases and the shipped file names."""
    return sorted(set(ACCELERATE_ALIASES) | {p.stem for p in ACCELERATE_CONFIGS_DIR.glob("*.yaml")})


def resolve_config(value: str) -> str:
    """A ``--config`` value: an existing file as is, else a shipped config by name (``tiny_cpu``/``tiny_cpu.yaml``)."""
    if Path(value).expanduser().is_file():
        return value
    shipped = CONFIGS_DIR / (value if value.endswith((".yaml", ".yml")) else f"{value}.yaml")
    if "/" not in value and shipped.is_file():
        return str(shipped)
    raise FileNotFoundError(
        f"--config {value}: no such file, and not a shipped config (one of: {', '.join(shipped_configs())})"
    )


def resolve_accelerate_config(value: str) -> str:
    """An ``--accelerate_config`` value: a short name (zero2, zero3, fsdp2, multi_gpu), a shipped file, or a path."""
    name = ACCELERATE_ALIASES.get(value, value.removesuffix(".yaml"))
    shipped = ACCELERATE_CONFIGS_DIR / f"{name}.yaml"
    if "/" not in value and shipped.is_file():
        return str(shipped)
    if Path(value).expanduser().is_file():
        return value
    raise FileNotFoundError(
        f"--accelerate_config {value}: not a shipped accelerate config (one of: "
        f"{', '.join(shipped_accelerate_configs())}) nor a file"
    )


def resolve_config_argv(argv: list[str]) -> list[str]:
    """``argv`` with the value of ``--config`` (``--config X`` or ``--config=X``) resolved (:func:`resolve_config`)."""
    out = list(argv)
    for i, item in enumerate(out):
        if item == "--config" and i + 1 < len(out):
            out[i + 1] = resolve_config(out[i + 1])
        elif item.startswith("--config="):
            out[i] = "--config=" + resolve_config(item.partition("=")[2])
    return out


def parse_script_args(dataclasses: tuple, argv: list[str] | None) -> tuple:
    """``TrlParser(dataclasses)`` on ``argv`` (default: the command line), with a shipped config accepted by name;
    the first dataclass's ``tiny_models_dir``, when set and missing, is filled with tiny models first (once, on the
    main process)."""
    import os
    import sys

    from accelerate import PartialState
    from trl import TrlParser

    argv = resolve_config_argv(sys.argv[1:] if argv is None else argv)
    parsed = TrlParser(dataclasses).parse_args_and_config(argv)
    folder = getattr(parsed[0], "tiny_models_dir", None)
    if folder and not os.path.isdir(folder):
        with PartialState().main_process_first():
            if not os.path.isdir(folder):
                from trl_ppomax.tiny import save_tiny_models

                save_tiny_models(folder)
    return parsed


def setup_distributed(training_args) -> None:
    """Join the process group, DeepSpeed's included, before any model is loaded.

    Under ZeRO-3, transformers builds each model inside DeepSpeed's ``zero.Init``, which checks the DeepSpeed config's
    batch sizes against the world size of DeepSpeed's communication backend *before* setting that backend up: with a
    DeepSpeed JSON of the user's own (explicit ``train_batch_size``) it saw one process and failed
    ("train_batch_size 16 != 4 * 2 * 1"). The training arguments set the torch process group up (``device``);
    on CPU processes accelerate leaves DeepSpeed's backend alone, so it is set up here, on top of that group."""
    import torch.distributed

    training_args.device  # noqa: B018  (sets up the distributed state once, as the Trainer would)
    if getattr(training_args, "deepspeed_plugin", None) is None or not torch.distributed.is_initialized():
        return
    from deepspeed import comm

    if not comm.is_initialized():
        comm.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)


def model_kwargs(model_args) -> dict:
    """The ``from_pretrained`` keyword arguments of trl's ``ModelConfig``: revision, attention, dtype, quantisation."""
    from trl import get_quantization_config

    return dict(
        revision=model_args.model_revision,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
        quantization_config=get_quantization_config(model_args),
    )
