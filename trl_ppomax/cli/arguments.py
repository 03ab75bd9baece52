"""What the training commands ``trl-ppomax ppo`` and ``reward`` (and the recipes wrapping them) and every command's
parser share: shipped configs, config files, flags and errors. Nothing heavy is imported at module level.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from pathlib import Path

from trl_ppomax.base import compat

COMMANDS_DIR = Path(__file__).resolve().parent
CONFIGS_DIR = COMMANDS_DIR / "configs"
ACCELERATE_CONFIGS_DIR = COMMANDS_DIR / "accelerate_configs"

# --accelerate_config short names (as trl's), besides the shipped file names without ".yaml"
ACCELERATE_ALIASES = {"zero2": "deepspeed_zero2", "zero3": "deepspeed_zero3", "fsdp2": "fsdp"}


def config_command(name: str) -> str:
    """The command a shipped training config belongs to: ``reward`` for the ``reward_*`` ones, else ``ppo``."""
    return "reward" if Path(name).stem.startswith("reward_") else "ppo"


def shipped_configs(command: str | None = None) -> list[str]:
    """Names of the training configs shipped with the package (``--config NAME``): all, or those of ``command``
    (``ppo`` or ``reward``, :func:`config_command`)."""
    names = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
    return [name for name in names if command is None or config_command(name) == command]


def shipped_accelerate_configs() -> list[str]:
    """Names accepted by ``--accelerate_config``: the short aliases and the shipped file names."""
    return sorted(set(ACCELERATE_ALIASES) | {p.stem for p in ACCELERATE_CONFIGS_DIR.glob("*.yaml")})


def resolve_config(value: str, command: str | None = None) -> str:
    """A ``--config`` value: an existing file as is, else a shipped config by name (``tiny_cpu``/``tiny_cpu.yaml``);
    with ``command``, only a shipped config of that command."""
    if Path(value).expanduser().is_file():
        return value
    shipped = CONFIGS_DIR / (value if value.endswith((".yaml", ".yml")) else f"{value}.yaml")
    names = ", ".join(shipped_configs(command))
    if "/" not in value and shipped.is_file():
        if command is None or config_command(shipped.stem) == command:
            return str(shipped)
        other = config_command(shipped.stem)
        raise FileNotFoundError(
            f"--config {value}: a config of `trl-ppomax {other}`, not of `trl-ppomax {command}` (its configs: {names})"
        )
    raise FileNotFoundError(f"--config {value}: no such file, and not a shipped config (one of: {names})")


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


def resolve_config_argv(argv: list[str], command: str | None = None) -> list[str]:
    """``argv`` with the value of ``--config`` (``--config X`` or ``--config=X``) resolved (:func:`resolve_config`)."""
    out = list(argv)
    for i, item in enumerate(out):
        if item == "--config" and i + 1 < len(out):
            out[i + 1] = resolve_config(out[i + 1], command)
        elif item.startswith("--config="):
            out[i] = "--config=" + resolve_config(item.partition("=")[2], command)
    return out


#: New names of transformers ≥ 5.20 a config may use, and the names of older transformers (the shipped configs use the
#: new ones, which do not warn; on older versions they are read as the old ones).
RENAMED_FIELDS = {
    "activation_checkpointing": "gradient_checkpointing",
    "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs",
}


class ConfigError(ValueError):
    """A ``--config`` file or a flag the parser cannot take: reported on one line, exit status 2, no traceback."""


def _did_you_mean(name: str, known) -> str:
    """`` — did you mean 'NEAREST'?`` for the known name nearest ``name``, else a pointer to ``--help``."""
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return f" — did you mean {match[0]!r}?" if match else " (see --help for every field)"


def split_flag(argv: list[str], names: tuple[str, ...], missing: str) -> tuple[str | None, list[str]]:
    """Take ``NAME VALUE`` or ``NAME=VALUE`` (``NAME`` one of ``names``) out of ``argv``: ``(value, the rest)``;
    :class:`ConfigError` ``missing`` (``{flag}`` the flag) when ``NAME`` ends ``argv``."""
    value, rest, items = None, [], iter(argv)
    for item in items:
        if item in names:
            value = next(items, None)
            if value is None:
                raise ConfigError(missing.format(flag=item))
        elif item.startswith(tuple(f"{name}=" for name in names)):
            value = item.partition("=")[2]
        else:
            rest.append(item)
    return value, rest


def read_config(path: str, fields) -> dict:
    """The settings of the YAML config ``path``, checked against the names the parser takes (``fields``): an unknown
    name (a typo), a file that is not a YAML mapping, or an ``env`` section that is not one raise :class:`ConfigError`
    naming the file (and the nearest field, ``learnig_rate`` → ``learning_rate``). ``env`` stays in the result."""
    import yaml  # a dependency of transformers, accelerate and datasets

    try:
        with open(path) as file:
            config = yaml.safe_load(file)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(err).split())}") from None
    except OSError as err:
        raise ConfigError(f"--config {path}: {err.strerror or err}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ConfigError(f"{path} must hold a YAML mapping of field: value, got a {type(config).__name__}")
    if not isinstance(config.get("env", {}), dict):
        raise ConfigError(f"`env` in {path} must be a mapping of environment variables")
    fields = set(fields)
    for new, old in RENAMED_FIELDS.items():
        if new in config and new not in fields and old in fields:
            config[old] = config.pop(new)
    unknown = [str(key) for key in config if key != "env" and key not in fields]
    if unknown:
        raise ConfigError("; ".join(f"unknown field {key!r} in {path}{_did_you_mean(key, fields)}" for key in unknown))
    return config


def _parse(dataclasses: tuple, argv: list[str], prog: str | None) -> tuple:
    """TrlParser's ``parse_args_and_config``, with the config file and the unknown flags checked first
    (:class:`ConfigError`, instead of TRL's traceback advising to edit the dataclass)."""
    from trl import TrlParser

    parser = TrlParser(dataclasses, **({"prog": prog} if prog else {}))
    path, argv = split_flag(argv, ("--config",), "argument {flag}: expected one argument")
    if path is not None:
        config = read_config(path, compat.parser_destinations(parser))
        for key, value in config.pop("env", {}).items():
            os.environ[key] = str(value)
        parser.set_defaults_with_config(**config)
    *parsed, unknown = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
    if unknown:
        raise ConfigError("; ".join(_unknown_arguments(unknown, compat.option_actions(parser))))
    return tuple(parsed)


def _unknown_arguments(items: list[str], flags) -> list[str]:
    """What is wrong with each argument argparse left over: an unknown flag (its value, the next item, with it) or a
    stray value."""
    problems, after_flag = [], False
    for item in items:
        if item.startswith("--"):
            flag = item.partition("=")[0]
            problems.append(f"unknown flag {flag!r}{_did_you_mean(flag, flags)}")
            after_flag = "=" not in item
        elif not after_flag:
            problems.append(f"unrecognized argument {item!r}")
        else:
            after_flag = False
    return problems


def parse_script_args(dataclasses: tuple, argv: list[str] | None, prog: str | None = None) -> tuple:
    """``TrlParser(dataclasses)`` on ``argv`` (default: the command line), with a shipped config accepted by name;
    the first dataclass's ``tiny_models_dir``, when set and missing, is filled with tiny models first (once, on the
    main process). A config file or flag it cannot take (an unknown field, a typo) ends the process as argparse does:
    ``PROG: error: unknown field 'learnig_rate' in FILE — did you mean 'learning_rate'?`` on stderr, exit status 2."""
    from accelerate import PartialState

    try:
        parsed = _parse(dataclasses, resolve_config_argv(sys.argv[1:] if argv is None else argv), prog)
    except (ConfigError, FileNotFoundError) as err:
        print(f"{prog or os.path.basename(sys.argv[0])}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    folder = getattr(parsed[0], "tiny_models_dir", None)
    if folder and not os.path.isdir(folder):
        with PartialState().main_process_first():
            if not os.path.isdir(folder):
                from trl_ppomax.toyworld.tiny import save_tiny_models

                save_tiny_models(folder)
    return parsed


def setup_distributed(training_args) -> None:
    """Join the process group, DeepSpeed's included, before any model is loaded: under ZeRO-3, transformers builds each
    model inside ``zero.Init``, which checks the DeepSpeed config's batch sizes against the world size of DeepSpeed's
    backend before setting it up (a user's JSON with ``train_batch_size`` saw one process: "train_batch_size 16 != 4 *
    2 * 1"). ``device`` sets the torch group up; on CPU accelerate leaves DeepSpeed's alone, so it is set up here."""
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


# -- What every command's parser and error shares ----------------------------------------------------------------------
def fail(command: str, error) -> int:
    """Print ``trl-ppomax COMMAND: error: ERROR`` on one line of stderr; returns the exit status, 2."""
    print(f"trl-ppomax {command}: error: {' '.join(str(error).split())}", file=sys.stderr)
    return 2


def positive_int(text: str) -> int:
    """An argparse ``type``: a whole number ≥ 1 (``--iterations 0`` is refused when parsed, naming the flag)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default (unless its help already says it), and keeps the descriptions' line breaks."""

    def _get_help_string(self, action):
        if action.help and "default:" in action.help:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An argument parser whose help (and its sub-commands' help) shows the defaults, and which takes flags only as
    spelt (no prefix matching, which made ``--judge`` ambiguous and would take ``--judge-m`` for ``--judge-model``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def add_command(commands, name: str, run, note: str = "") -> argparse.ArgumentParser:
    """The sub-command ``name``, run by ``run``, whose docstring (plus ``note``) is its help and description."""
    parser = commands.add_parser(name, help=run.__doc__, description=run.__doc__ + note)
    parser.set_defaults(run=run)
    return parser
