"""The house rules of the package's layout (issues 32 and 45), checked on the code itself: a shallow root, small
functions, no module using another module's private names, and imports that point down the layers."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import transformers

PACKAGE = Path(__file__).resolve().parents[1] / "trl_ppomax"


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_and_used(tree: ast.AST) -> tuple[set[str], list[tuple[int, str]]]:
    """The private names a module defines (functions, classes, assigned names and attributes) and those it uses (an
    attribute read or written, a name imported)."""
    defined, used = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        if isinstance(node, ast.Attribute):
            used.append((node.lineno, node.attr))
        elif isinstance(node, ast.ImportFrom):
            used += [(node.lineno, alias.name) for alias in node.names]
    return {name for name in defined if private(name)}, [(line, name) for line, name in used if private(name)]


def cross_module_private_uses(package: Path) -> list[str]:
    """``module:line: name`` for every private name a module uses that another module of ``package`` defines and it
    does not. Names of transformers' ``Trainer`` and ``PretrainedConfig`` (which our trainers override or read) are
    theirs, not ours."""
    theirs = set(dir(transformers.Trainer)) | set(vars(transformers.PretrainedConfig()))
    modules = {path: defined_and_used(ast.parse(path.read_text())) for path in sorted(package.rglob("*.py"))}
    owners = defaultdict(set)
    for path, (defined, _) in modules.items():
        for name in defined:
            owners[name].add(path)
    return [
        f"{path.relative_to(package.parent)}:{line}: {name}"
        for path, (defined, used) in modules.items()
        for line, name in used
        if owners.get(name) and name not in defined and name not in theirs
    ]


def test_no_module_uses_another_modules_private_names():
    assert cross_module_private_uses(PACKAGE) == []


def test_the_check_finds_a_private_name_used_across_modules(tmp_path):
    (tmp_path / "a.py").write_text("def _helper():\n    return 1\n")
    (tmp_path / "b.py").write_text(
        "from a import _helper\n\nclass B:\n    def run(self, other):\n        return other._state\n"
    )
    (tmp_path / "c.py").write_text("class C:\n    def __init__(self):\n        self._state = 0\n")
    assert cross_module_private_uses(tmp_path) == [
        f"{tmp_path.name}/b.py:1: _helper",
        f"{tmp_path.name}/b.py:5: _state",
    ]


def test_the_package_root_is_shallow():
    entries = [p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()]
    assert len(entries) <= 13, sorted(entries)


def test_no_function_is_over_sixty_lines():
    long = {
        f"{path.relative_to(PACKAGE)}:{node.name}": node.end_lineno - node.lineno + 1
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 60
    }
    assert long == {}


# ---- the layers (docs/architecture.md) -------------------------------------------------------------------------------
#: Which of our top-level parts each part must never import (lazy imports included): the bottom layer imports none of
#: ours; data, models and the run's records (``reporting``: model cards, tracker tables, figures, which the trainers
#: and the tools both write through) never import the algorithm (``ppo``); generation and rewards never import it
#: either; the algorithm never imports the tooling on top; ``data`` never imports the paper's release.
TOOLING = {"judging", "cli", "moss", "toyworld"}
PARTS = {"base", "data", "models", "reporting", "generation", "rewards", "ppo", "reward_modeling", *TOOLING}
LOWER = {"ppo", "generation", "rewards", "reward_modeling", *TOOLING}
FORBIDDEN = {
    "base": PARTS - {"base"},
    "data": LOWER | {"models", "reporting"},
    "models": LOWER | {"reporting"},
    "reporting": LOWER,
    "generation": {"ppo", "reward_modeling", *TOOLING},
    "rewards": {"ppo", "generation", "reward_modeling", *TOOLING},
    "ppo": TOOLING | {"reward_modeling"},
}


def part_of(module: str) -> str | None:
    """``trl_ppomax.<part>[.…]`` → part (``models`` for ``models.py``); None for the package root."""
    parts = module.split(".")
    return parts[1] if parts[0] == "trl_ppomax" and len(parts) > 1 else None


def imported_parts(tree: ast.AST) -> set[str]:
    """The parts of ours a module imports, at the top or inside functions (``from trl_ppomax import data`` → data)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trl_ppomax":
            named = [f"{node.module}.{alias.name}" for alias in node.names] if node.module == "trl_ppomax" else []
            found |= {part_of(name) for name in [node.module, *named]}
        elif isinstance(node, ast.Import):
            found |= {part_of(alias.name) for alias in node.names}
    return found & PARTS


def wrong_way_imports(package: Path) -> list[str]:
    """``path → part`` for every import a module makes that :data:`FORBIDDEN` rules out for its part."""
    wrong = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        part = relative.parts[0].removesuffix(".py")
        for imported in imported_parts(ast.parse(path.read_text())) & FORBIDDEN.get(part, set()):
            wrong.append((relative.as_posix(), imported))
    return sorted(wrong)


def test_imports_point_down_the_layers():
    assert wrong_way_imports(PACKAGE) == []


def test_the_layer_check_finds_an_upward_import(tmp_path):
    package = tmp_path / "trl_ppomax"
    (package / "base").mkdir(parents=True)
    (package / "base" / "core.py").write_text("def f():\n    from trl_ppomax.ppo import trainer\n")
    (package / "data.py").write_text("from trl_ppomax import moss, base\n")
    assert wrong_way_imports(package) == [("base/core.py", "ppo"), ("data.py", "moss")]


# ---- one iteration (docs/architecture.md, "One iteration, file by file") ---------------------------------------------
#: The files that hold the steps of one default iteration, in the order it runs them.
ITERATION_FILES = (
    "ppo/trainer.py",
    "ppo/rollouts.py",
    "generation/__init__.py",
    "ppo/scoring.py",
    "ppo/experience.py",
    "ppo/update.py",
)
#: What those steps call by name: the maths, metric names and rollout types (``base/``), prompts (``data/``), models,
#: reward sources, the config's derived settings, and the update's micro-batching, optimizer step, estimator table
#: and skip counters.
ITERATION_HELPERS = (
    "base/",
    "data/",
    "models.py",
    "rewards/",
    "ppo/config.py",
    "ppo/batching.py",
    "ppo/optim.py",
    "ppo/advantages.py",
    "ppo/state.py",
    "generation/correction.py",
)


def files_run_by(call) -> list[str]:
    """The package files (relative to the package) whose functions run during ``call()``, in order of first call."""
    import sys

    seen: dict[str, None] = {}

    def profile(frame, event, arg):
        path = Path(frame.f_code.co_filename)
        if event == "call" and path.is_relative_to(PACKAGE):
            seen.setdefault(path.relative_to(PACKAGE).as_posix())

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return list(seen)


def test_one_iteration_is_followed_in_six_files(tmp_path):
    from helpers import changed, make_trainer, snapshot

    from trl_ppomax.ppo.state import start_trainer_state

    trainer = make_trainer(tmp_path)
    start_trainer_state(trainer.state, trainer.args, len(trainer.train_dataset) * trainer.args.num_samples_per_prompt)
    before = snapshot(trainer.model)
    files = files_run_by(lambda: trainer.training_iteration(1))
    assert [name for name in files if not name.startswith(ITERATION_HELPERS)] == list(ITERATION_FILES)
    assert changed(before, trainer.model) > 0, "the iteration trained nothing"
