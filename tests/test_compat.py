"""``trl_ppomax.base.compat``: every third-party private name the package uses still exists in the installed versions,
and the wrappers do what the callers rely on."""

from __future__ import annotations

import argparse
import importlib
import inspect

import pytest

from trl_ppomax.base import compat


@pytest.mark.parametrize("module, owner, name", compat.PRIVATE_NAMES, ids=lambda value: str(value))
def test_each_private_name_exists_in_the_installed_version(module, owner, name):
    try:
        cls = getattr(importlib.import_module(module), owner)
    except ImportError as error:  # an optional extra (vLLM) not installed here
        pytest.skip(f"{module} is not installed: {error}")
    assert callable(getattr(cls, name, None)), f"{module}.{owner}.{name} is gone (checked on {compat.CHECKED_ON})"


def test_trl_trainers_still_keep_their_metrics_in_metrics():
    from trl import RewardTrainer

    assert "self._metrics" in inspect.getsource(RewardTrainer)


def test_the_parser_wrappers_read_an_argparse_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--learning_rate", type=float)
    parser.add_argument("--seed", type=int)
    assert compat.parser_destinations(parser) == {"learning_rate", "seed"}
    assert {"--learning_rate", "--seed", "-h", "--help"} <= set(compat.option_actions(parser))


def test_no_other_module_uses_these_private_names():
    """The wrappers are the only uses: a private name of the list written anywhere else in the package fails."""
    from pathlib import Path

    package = Path(compat.__file__).resolve().parents[1]
    names = [name for _, _, name in compat.PRIVATE_NAMES] + ["_actions", "_option_string_actions", "_lazy_init"]
    elsewhere = [
        f"{path.relative_to(package)}: {name}"
        for path in package.rglob("*.py")
        if path.name != "compat.py"
        for name in names
        if f"._{name.lstrip('_')}(" in path.read_text() or f".{name}" in path.read_text()
    ]
    assert elsewhere == []
