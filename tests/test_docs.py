"""Docs are tests: every Python block and every shell command of README.md and docs/*.md (the pages of the mkdocs
site), read with Sybil.

- **Python blocks** run, those of one ``##`` section in order in one namespace, in a temporary folder where the Hub
  ids the docs name are local folders shaped as users have them (:mod:`user_setups`: pythia-style, no pad token, so
  the quick start adds ``[PAD]`` as TRL's example does), with a few settings shortened (:data:`SHORTER`). The README's
  quick start is the first block of the getting-started page's, which runs it (:data:`COPIES`).
- **Shell commands** are checked against the real parsers of what they call: every ``trl-ppomax`` command line
  parses (the training commands' fields through their own dataclasses), every ``accelerate launch`` line through
  accelerate's launcher, with its config files and script present and the script's flags known; ``pip install``
  names our extras; the test command is the one CI runs. Commands that need a GPU, the Hub or a 7B model cannot run
  here; the ones that can run on a CPU in seconds (:data:`RUN`) run for real.
- **The site**: every page of docs/ is in mkdocs.yml's ``nav`` and every ``nav`` entry is a page, and the README stays
  a front page (at most :data:`README_LINES` lines). The site itself is built by ``.ci/run`` (``mkdocs build
  --strict``, which checks every link and anchor), not by this suite.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import yaml
from sybil import Document
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
from user_setups import build_llama_style_tokenizer, write_plain_folders, write_qwen_instruct_folder

from trl_ppomax.moss import setup_tokenizer
from trl_ppomax.toyworld.tiny import llama_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: README sections whose Python blocks are the first blocks of a docs section: they are checked to be the same text
#: and run there, once (a quick start trains a policy).
COPIES = {("README.md", "Quick start"): ("getting-started.md", "Quick start")}
#: The README is the front page; the manual is docs/.
README_LINES = 250
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
            if (path.name, heading) not in found and (path.name, heading) not in COPIES:
                found.append((path.name, heading))
    return found


def python_blocks(name: str, heading: str) -> list[str]:
    """The source of the Python blocks of section ``heading`` of document ``name``, in order."""
    path = next(p for p in DOCS if p.name == name)
    doc = document(path, PythonCodeBlockParser())
    return [str(e.parsed) for e in doc.examples() if section_of(doc.text, e.start) == heading]


def section_of(text: str, offset: int) -> str:
    """The ``## `` heading above ``offset`` in ``text`` ("" before the first)."""
    headings = [m for m in re.finditer(r"^## (.+)$", text[:offset], re.M)]
    return headings[-1].group(1) if headings else ""


def save_moss_models(folder: Path) -> None:
    """A tiny LLaMA-style policy and reward model with the MOSS-RLHF tokenizer set-up, as `moss recover` writes."""
    tokenizer = setup_tokenizer(build_llama_style_tokenizer("en"), "en")
    config = llama_config(tokenizer)  # hidden 32, 2 layers, the tokenizer's special ids
    for name, cls in (("moss-sft-7b-en", LlamaForCausalLM), ("moss-reward-7b-en", LlamaForSequenceClassification)):
        cls(LlamaConfig(**config.to_dict(), num_labels=1)).save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """The docs' Hub ids as local folders: the cleanrl pythia SFT and reward models as pythia-shaped folders whose
    tokenizer has no pad token, the MOSS-RLHF models as ``moss recover`` writes them, and Qwen 2.5 Instruct (its own
    chat template, tool calling included)."""
    folder = tmp_path_factory.mktemp("docs-models")
    plain = write_plain_folders(folder / "plain", "gpt_neox", embedding="padded", pad=None)
    for kind in ("sft", "reward"):
        (folder / "cleanrl").mkdir(exist_ok=True)
        os.symlink(plain[kind], folder / "cleanrl" / f"EleutherAI_pythia-1b-deduped__{kind}__tldr")
    save_moss_models(folder)
    write_qwen_instruct_folder(folder / "Qwen" / "Qwen2.5-0.5B-Instruct")
    return folder


#: Sections that build the toy world (half a minute cold): slow, so the README's command builds none (.ci/run runs them).
BUILDS_THE_WORLD = {("evaluation.md", "In Python"), ("toy-world.md", "Run it in Python")}


@pytest.mark.parametrize(
    ("name", "heading"),
    [pytest.param(n, h, marks=[pytest.mark.slow] if (n, h) in BUILDS_THE_WORLD else []) for n, h in python_sections()],
    ids=[f"{n}: {h}" for n, h in python_sections()],
)
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


@pytest.mark.parametrize(("copy", "original"), COPIES.items(), ids=[f"{c[0]}: {c[1]}" for c in COPIES])
def test_copied_python_blocks_are_the_ones_that_run(copy, original):
    blocks = python_blocks(*copy)
    assert blocks, f"{copy} has no Python blocks any more: drop it from COPIES"
    assert blocks == python_blocks(*original)[: len(blocks)], f"{copy[0]}'s {copy[1]!r} differs from {original[0]}'s"


# --------------------------------------------------------------------------------------------------------------------
# The site
# --------------------------------------------------------------------------------------------------------------------
class _MkDocsLoader(yaml.SafeLoader):
    """mkdocs.yml as data: its ``!!python/...`` tags (the slugify function) read as None, nothing is imported."""


_MkDocsLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def nav_pages(entries) -> list[str]:
    """Every page a mkdocs ``nav`` names, depth first."""
    if isinstance(entries, str):
        return [entries]
    if isinstance(entries, dict):
        return [page for value in entries.values() for page in nav_pages(value)]
    return [page for entry in entries for page in nav_pages(entry)]


def test_every_page_is_in_the_nav():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_MkDocsLoader)
    docs_dir = ROOT / config.get("docs_dir", "docs")
    listed = nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(docs_dir)) for p in docs_dir.rglob("*.md"))
    assert len(set(listed)) == len(listed), "a page is in the nav twice"
    missing, absent = sorted(set(pages) - set(listed)), sorted(set(listed) - set(pages))
    assert not missing, f"pages missing from mkdocs.yml's nav: {missing}"
    assert not absent, f"nav entries with no page: {absent}"
    assert all(p.parent == ROOT / "docs" for p in docs_dir.rglob("*.md")), "DOCS reads docs/*.md only: add the folder"


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines: move sections into docs/"


def github_anchors(path: Path) -> set[str]:
    """The anchors GitHub (and the site, whose slugify is GitHub's) gives the headings of ``path``."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    headings = re.findall(r"^#{1,6} (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.replace("`", "").strip().lower()).replace(" ", "-") for h in headings}


def test_the_readme_links_resolve():
    """The README is read on GitHub and PyPI, outside the site's strict build: its links into docs/ must hold."""
    links = re.findall(r"\]\(([^)#\s]+\.md)(?:#([^)\s]+))?\)", (ROOT / "README.md").read_text())
    assert links
    for target, anchor in links:
        assert (ROOT / target).is_file(), f"README.md links to {target}, which does not exist"
        assert not anchor or anchor in github_anchors(ROOT / target), f"{target} has no heading #{anchor}"


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

    from trl_ppomax.cli.arguments import resolve_accelerate_config, resolve_config

    if command == "ppo":
        from trl_ppomax.cli.ppo import PPOMaxScriptArguments as Script
        from trl_ppomax.ppo.config import PPOMaxConfig

        types = (Script, PPOMaxConfig, ModelConfig)
    else:
        from trl_ppomax.cli.reward import RewardScriptArguments as Script
        from trl_ppomax.reward_modeling.config import PPOMaxRewardConfig

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
    elif program in ("python", "python3") and argv[:2] == ["-m", "mkdocs"]:
        check_mkdocs(argv[2:])
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


def check_mkdocs(argv: list[str]) -> None:
    """``mkdocs build|serve ...``: a command of mkdocs' own CLI (parsed by it when the docs extra is installed), run
    where mkdocs.yml is; a build is strict, as in ``.ci/run``."""
    assert argv and argv[0] in ("build", "serve"), f"mkdocs {' '.join(argv)}: the docs use build and serve"
    assert (ROOT / "mkdocs.yml").is_file(), "mkdocs.yml does not exist"
    if argv[0] == "build":
        assert "--strict" in argv, "the docs build is strict (as .ci/run builds it)"
        assert "-m mkdocs build --strict" in (ROOT / ".ci" / "run").read_text(), ".ci/run does not build the docs"
    try:
        from mkdocs.__main__ import cli
    except ImportError:  # the docs extra is not installed: the command's shape is checked above
        return
    import click

    try:
        cli.commands[argv[0]].make_context(argv[0], argv[1:])
    except click.ClickException as error:
        raise AssertionError(f"mkdocs {' '.join(argv)}: {error.format_message()}") from error


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
        "python3 -m mkdocs biuld --strict",
        "python3 -m mkdocs build",  # not strict
    ],
)
def test_the_command_check_catches_drift(command):
    with pytest.raises((AssertionError, SystemExit, FileNotFoundError, ValueError)):
        check_command(command)


@pytest.mark.parametrize("command", RUN)
def test_cheap_commands_run(command, tmp_path, monkeypatch):
    """In-process, as the installed ``trl-ppomax`` would run it (``tests/test_tiny.py`` runs the console script)."""
    from trl_ppomax.cli import main

    assert any(command == c for _, c in shell_commands()), f"{command!r} is not in the docs any more"
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(command)[1:]) == 0
