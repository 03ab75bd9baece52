"""Third-party private names, in one place: each wrapper below is the only use in the package of a private method or
attribute of transformers, trl, torch or argparse, checked on the versions in :data:`CHECKED_ON`
(``tests/test_compat.py`` checks that each still exists in the installed versions, so an upgrade that drops one fails
there, by name, not deep in a run)."""

from __future__ import annotations

#: The versions these private names were read on.
CHECKED_ON = {"transformers": "5.24.0", "trl": "1.16.0", "torch": "2.13.0", "python": "3.11"}

#: ``(module, class, name)`` of every private name used here that the class itself defines (the test's list).
PRIVATE_NAMES = (
    ("transformers", "Trainer", "_save_optimizer_and_scheduler"),
    ("transformers", "Trainer", "_save_rng_state"),
    ("transformers", "Trainer", "_load_optimizer_and_scheduler"),
    ("transformers", "Trainer", "_load_rng_state"),
    ("transformers", "Trainer", "_finish_current_push"),
    ("transformers", "Trainer", "_determine_best_metric"),
    ("trl.generation.vllm_generation", "VLLMGeneration", "_iter_named_params"),
    ("torch.distributed.fsdp", "FSDPModule", "_get_fsdp_state"),
)


# ---- transformers.Trainer: checkpoint files and best-model bookkeeping, as its own save and resume write them -------
def save_optimizer_and_scheduler(trainer, folder: str) -> None:
    """The optimizer and LR scheduler states into ``folder`` (DeepSpeed's and FSDP's engine files too)."""
    trainer._save_optimizer_and_scheduler(folder)


def save_rng_state(trainer, folder: str) -> None:
    """Each process's RNG states into ``folder`` (``rng_state_<rank>.pth``)."""
    trainer._save_rng_state(folder)


def load_optimizer_and_scheduler(trainer, folder: str) -> None:
    trainer._load_optimizer_and_scheduler(folder)


def load_rng_state(trainer, folder: str) -> None:
    trainer._load_rng_state(folder)


def finish_current_push(trainer) -> None:
    """Wait for the background ``push_to_hub`` upload of the last checkpoint (what the Trainer does at train end)."""
    trainer._finish_current_push()


def determine_best_metric(trainer, metrics: dict[str, float]) -> bool:
    """Update ``trainer.state``'s best metric and checkpoint from evaluation ``metrics``; whether this is the best."""
    return trainer._determine_best_metric(metrics, trial=None)


# ---- trl ------------------------------------------------------------------------------------------------------------
def vllm_named_parameters(generation):
    """``(name, tensor)`` of the policy's weights under vLLM's names (PEFT merged), as trl's ``VLLMGeneration`` streams
    them in ``sync_weights``."""
    return generation._iter_named_params()


def trainer_metrics(trainer) -> dict:
    """trl trainers' ``{"train" | "eval": {name: [values]}}`` of metrics averaged into the next log."""
    return trainer._metrics


# ---- torch FSDP2 ----------------------------------------------------------------------------------------------------
def fsdp_lazy_init(module) -> None:
    """What an FSDP2 root module's first forward does (a no-op after it), so that its parts can be called alone."""
    module._get_fsdp_state()._lazy_init()


# ---- argparse -------------------------------------------------------------------------------------------------------
def parser_destinations(parser) -> set[str]:
    """Every ``dest`` a parser fills (the config-file keys it accepts), ``help`` left out."""
    return {action.dest for action in parser._actions if action.dest != "help"}


def option_actions(parser) -> dict:
    """``{option string: action}`` of a parser (for naming the nearest option to an unknown one)."""
    return parser._option_string_actions
