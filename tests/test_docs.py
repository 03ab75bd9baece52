"""Docs are tests: every Python block and every shell command of README.md and docs/*.md, read with Sybil.

- **Python blocks** run, those of one ``##`` section in order in one namespace, in a temporary folder where the Hub
  ids the docs name are local folders shaped as users have them (:mod:`user_setups`: pythia-style, no pad token, so
  the quick start adds ``[PAD]`` as TRL's example does), with a few settings shortened (:data:`SHORTER`).
- **Shell commands** are checked against the real parsers of what they call: every ``trl-ppomax`` command line
  parses (the training commands' fields through their own dataclasses), every ``accelerate launch`` line through
  accelerate's launcher, with its config files and script present and the script's flags known; ``pip install``
  names our extras; the test command is the one CI runs. Commands that need a GPU, the Hub or a 7B model cannot run
  here; the ones that can run on a CPU in seconds (:data:`RUN`) run for real.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from sybil import Document
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
from user_setups import write_plain_folders

from trl_ppomax.moss import setup_tokenizer
from trl_ppomax.tiny import build_llama_style_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Settings made shorter for the test (the docs show real values).
SHORTER = {"iterations=60": "iterations=2", "total_episodes=128_000": "total_episodes=64"}
#: Commands cheap enough to run for real on a CPU (in a temporary folder).
RUN = ("trl-ppomax tiny tiny",)
#: Programs of other projects the docs call, checked only to be what they are (no parser of ours applies).
FOREIGN = ("srun", "scontrol", "export", "MAIN=$(scontrol")


def document(path: Path, *parsers) -> Document:
    """``path`` parsed by ``parsers``, with :data:`SHORTER` applied to its text."""
    text = path.read_text()
    for real, short in SHORTER.items():
        text = text.replace(real, short)
    doc = Document(text, str(path))
    for parser in parsers:
        for region in parser(doc):
            doc.add(region)
    return doc


def python_sections() -> list[tuple[str, str]]:
    """``(document name, ## heading)`` of every section holding Python blocks, in order."""
    found = []
    for path in DOCS:
        doc = document(path, PythonCodeBlockParser())
        for example in doc.examples():
            heading = section_of(doc.text, example.start)
            if (path.name, heading) not in found:
                found.append((path.name, heading))
    return found


def section_of(text: str, offset: int) -> str:
    """The ``## `` heading above ``offset`` in ``text`` ("" before the first)."""
    headings = [m for m in re.finditer(r"^## (.+)$", text[:offset], re.M)]
    return headings[-1].group(1) if headings else ""


def save_moss_models(folder: Path) -> None:
    """A tiny LLaMA-style policy and reward model with the MOSS-RLHF tokenizer set-up, as `moss recover` writes."""
    tokenizer = setup_tokenizer(build_llama_style_tokenizer("en"), "en")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    for name, cls in (("moss-sft-7b-en", LlamaForCausalLM), ("moss-reward-7b-en", LlamaForSequenceClassification)):
        cls(LlamaConfig(**config.to_dict(), num_labels=1)).save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """The docs' Hub ids as local folders: the cleanrl pythia SFT and reward models as pythia-shaped folders whose
    tokenizer has no pad token, and the MOSS-RLHF models as ``moss recover`` writes them."""
    folder = tmp_path_factory.mktemp("docs-models")
    plain = write_plain_folders(folder / "plain", "gpt_neox", embedding="padded", pad=None)
    for kind in ("sft", "reward"):
        (folder / "cleanrl").mkdir(exist_ok=True)
        os.symlink(plain[kind], folder / "cleanrl" / f"EleutherAI_pythia-1b-deduped__{kind}__tldr")
    save_moss_models(folder)
    return folder


@pytest.mark.parametrize(("name", "heading"), python_sections(), ids=[f"{n}: {h}" for n, h in python_sections()])
def test_python_blocks_run(name, heading, models, tmp_path, monkeypatch, cache_root):
    for entry in models.iterdir():
        (tmp_path / entry.name).symlink_to(entry)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRL_PPOMAX_CACHE", str(cache_root))  # the toy world built once per test session
    path = next(p for p in DOCS if p.name == name)
    doc = document(path, PythonCodeBlockParser())
    doc.namespace["__name__"] = "__docs__"
    examples = [e for e in doc.examples() if section_of(doc.text, e.start) == heading]
    assert examples
    for example in examples:
        example.evaluate()


# --------------------------------------------------------------------------------------------------------------------
# Shell commands
# --------------------------------------------------------------------------------------------------------------------
def shell_commands() -> list[tuple[str, str]]:
    """``(document name, command)`` for every command of every ``bash`` block: continuation lines joined, comments
    dropped, ``a && b`` and ``a & b`` split."""
    found = []
    for path in DOCS:
        doc = document(path, CodeBlockParser(language="bash"))
        for example in doc.examples():
            block = example.parsed if isinstance(example.parsed, str) else str(example.parsed)
            lines = []
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"(^|\s)#.*$", "", line).strip() if not line.startswith("#!") else ""
                lines += [part.strip() for part in re.split(r"\s&&\s|\s&$|\s&\s", line) if part.strip()]
            found += [(path.name, line) for line in lines]
    return found


def check_training_flags(command: str, argv: list[str]) -> None:
    """``argv`` of ``trl-ppomax ppo|reward`` (or its recipe) names only fields of the command's dataclasses, and its
    ``--config`` a shipped config name or an existing file."""
    from transformers import HfArgumentParser
    from trl import ModelConfig

    from trl_ppomax.scripts import resolve_accelerate_config, resolve_config

    if command == "ppo":
        from trl_ppomax.ppo_config import PPOMaxConfig
        from trl_ppomax.scripts.ppo import PPOMaxScriptArguments as Script

        types = (Script, PPOMaxConfig, ModelConfig)
    else:
        from trl_ppomax.reward_config import PPOMaxRewardConfig
        from trl_ppomax.scripts.reward import RewardScriptArguments as Script

        types = (Script, PPOMaxRewardConfig, ModelConfig)
    rest = list(argv)
    for flag, resolve in (("--config", lambda v: resolve_config(v, command)), ("--accelerate_config", None)):
        if flag in rest:
            index = rest.index(flag)
            value = rest[index + 1]
            (resolve or resolve_accelerate_config)(str(ROOT / value) if (ROOT / value).is_file() else value)
            del rest[index : index + 2]
    _, unknown = HfArgumentParser(types).parse_known_args(rest)
    assert not unknown, f"trl-ppomax {command}: unknown flags {unknown}"


def check_command(command: str) -> None:
    """``command`` as its program would read it (see the module docstring)."""
    words = shlex.split(command)
    while words and re.match(r"^[A-Z_]+=", words[0]):  # environment assignments
        words.pop(0)
    program, argv = words[0], words[1:]
    if program == "trl-ppomax":
        from trl_ppomax.cli import build_parser

        if argv and argv[0] in ("ppo", "reward"):
            check_training_flags(argv[0], argv[1:])
        else:
            build_parser().parse_args(argv)  # SystemExit(2) on an unknown command or flag
    elif program == "accelerate":
        from accelerate.commands.launch import launch_command_parser

        assert argv[0] == "launch", command
        launched = launch_command_parser().parse_args(argv[1:])
        if launched.config_file:
            assert (ROOT / launched.config_file).is_file(), f"{launched.config_file} does not exist"
        script = ROOT / launched.training_script
        assert script.is_file(), f"{launched.training_script} does not exist"
        if script.parent.name == "recipes":
            kind = "reward" if "reward" in script.name else "ppo"
            script_argv = [a for a in launched.training_script_args if a != "..."]
            check_training_flags(kind, script_argv)
    elif program == "pip":
        assert argv[0] == "install", command
        extras = re.findall(r"\.\[([\w,]+)\]", command)
        pyproject = (ROOT / "pyproject.toml").read_text()
        for extra in ",".join(extras).split(",") if extras else []:
            assert re.search(rf"^{extra} = \[", pyproject, re.M), f"no extra {extra!r} in pyproject.toml"
    elif program in ("python", "python3") and argv[:2] == ["-m", "pytest"]:
        assert command.replace("python ", "python3 ") in (ROOT / ".ci" / "run").read_text()
    elif program in ("python", "python3"):
        assert (ROOT / argv[0]).is_file(), f"{argv[0]} does not exist"
    elif program == "trl":
        from transformers import HfArgumentParser
        from trl.scripts.vllm_serve import ScriptArguments as ServeArguments

        assert argv[0] == "vllm-serve", command
        _, unknown = HfArgumentParser(ServeArguments).parse_known_args(argv[1:])
        assert not unknown, f"trl vllm-serve: unknown flags {unknown}"
    elif program == "ruff":
        import ruff  # noqa: F401  (installed by the dev extra; CI's workflow runs it)
    else:
        assert command.startswith(FOREIGN), f"a command the docs test does not know: {command}"


@pytest.mark.parametrize(("name", "command"), shell_commands(), ids=[c[:60] for _, c in shell_commands()])
def test_shell_commands_are_what_their_programs_read(name, command):
    check_command(command)


@pytest.mark.parametrize(
    "command",
    [
        "trl-ppomax ppo --config tiny_cpu --kl_cof 0.1",  # a misspelt field
        "trl-ppomax ppo --config no_such_config",
        "trl-ppomax evaluate --policy a --baseline b --judge rm",  # evaluate's flag is --judges
        "accelerate launch --config_file recipes/accelerate/nope.yaml recipes/ppo_max.py",
        "accelerate launch recipes/ppo_max.py --config recipes/configs/tiny_cpu.yaml --learnig_rate 1",
        'pip install -e ".[nonexistent]"',
    ],
)
def test_the_command_check_catches_drift(command):
    with pytest.raises((AssertionError, SystemExit, FileNotFoundError, ValueError)):
        check_command(command)


@pytest.mark.parametrize("command", RUN)
def test_cheap_commands_run(command, tmp_path):
    assert any(command == c for _, c in shell_commands()), f"{command!r} is not in the docs any more"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    words = [sys.executable, "-m", "trl_ppomax.cli", *shlex.split(command)[1:]]
    result = subprocess.run(words, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
