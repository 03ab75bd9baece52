"""The house rules of the package's layout (issues 32 and 45), checked on the code itself: a shallow root, small
functions, no module (and no test) using another module's private names, imports that point down the layers, and a
test file named after each module of some size."""

from __future__ import annotations

import ast
from collections import Counter, defaultdict
from pathlib import Path

import transformers

PACKAGE = Path(__file__).resolve().parents[1] / "trl_ppomax"


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


#: The calls that name an attribute in a string: ``getattr(obj, "_x")``, ``monkeypatch.setattr(obj, "_x", value)``,
#: ``monkeypatch.setattr("package.module._x", value)``.
BY_NAME = {"getattr", "setattr", "hasattr", "delattr"}


def named_in_string(node: ast.Call) -> str | None:
    """The attribute a :data:`BY_NAME` call names in a string (the last part of a dotted path), else None."""
    called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
    strings = [
        arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None for arg in node.args
    ]
    if called not in BY_NAME or not strings:
        return None
    if len(strings) > 1 and strings[1] is not None:
        return strings[1]
    return strings[0].rsplit(".", 1)[-1] if strings[0] and "." in strings[0] else None


def defined_and_used(tree: ast.AST) -> tuple[set[str], list[tuple[int, str]]]:
    """The private names a module defines (functions, classes, assigned names and attributes) and those it uses (an
    attribute read or written, a name imported, an attribute named in a string to ``getattr``/``setattr``/…)."""
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
        elif isinstance(node, ast.Call) and (name := named_in_string(node)):
            used.append((node.lineno, name))
    return {name for name in defined if private(name)}, [(line, name) for line, name in used if private(name)]


def theirs() -> set[str]:
    """Names of transformers' ``Trainer`` and ``PretrainedConfig`` (which our trainers override or read): theirs, not
    ours, though our modules define some of them too."""
    return set(dir(transformers.Trainer)) | set(vars(transformers.PretrainedConfig()))


def cross_module_private_uses(package: Path) -> list[str]:
    """``module:line: name`` for every private name a module uses that another module of ``package`` defines and it
    does not, leaving out :func:`theirs`."""
    theirs_ = theirs()
    modules = {path: defined_and_used(ast.parse(path.read_text())) for path in sorted(package.rglob("*.py"))}
    owners = defaultdict(set)
    for path, (defined, _) in modules.items():
        for name in defined:
            owners[name].add(path)
    return [
        f"{path.relative_to(package.parent)}:{line}: {name}"
        for path, (defined, used) in modules.items()
        for line, name in used
        if owners.get(name) and name not in defined and name not in theirs_
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


def private_uses_in_tests(package: Path, tests: Path) -> list[str]:
    """``file:line: name`` for every private name a file under ``tests`` uses that a module of ``package`` defines
    and the file does not (a test reaches the package through its public names), leaving out :func:`theirs`."""
    ours = set().union(*(defined_and_used(ast.parse(path.read_text()))[0] for path in package.rglob("*.py")))
    ours -= theirs()
    found = []
    for path in sorted(tests.rglob("*.py")):
        defined, used = defined_and_used(ast.parse(path.read_text()))
        found += [f"{path.relative_to(tests.parent)}:{line}: {name}" for line, name in used if name in ours - defined]
    return found


def test_no_test_uses_a_private_name_of_the_package():
    assert private_uses_in_tests(PACKAGE, Path(__file__).resolve().parent) == []


def test_the_check_finds_a_private_name_a_test_uses(tmp_path):
    package, tests = tmp_path / "package", tmp_path / "tests"
    package.mkdir(), tests.mkdir()
    (package / "a.py").write_text(
        "def _helper():\n    return 1\n\nclass A:\n    def __init__(self):\n        self._seen = 0\n"
    )
    (tests / "test_a.py").write_text(
        "import a\n\ndef test_a(monkeypatch):\n    a.A()._seen\n"
        '    monkeypatch.setattr(a, "_helper", lambda: 2)\n    monkeypatch.setattr("package.a._helper", None)\n'
        '    getattr(a, "_helper")\n'
    )
    (tests / "test_own.py").write_text("def _helper():\n    return 2\n\ndef test_own():\n    assert _helper()\n")
    assert private_uses_in_tests(package, tests) == [
        "tests/test_a.py:4: _seen",
        "tests/test_a.py:5: _helper",
        "tests/test_a.py:6: _helper",
        "tests/test_a.py:7: _helper",
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


# ---- a test file per module (issue 45) -------------------------------------------------------------------------------
#: A module this long has a test file named after it, or after its folder.
TESTED_LINES = 120


def acceptable_test_files(package: Path) -> dict[str, set[str]]:
    """For each module of ``package`` (``pkg/x.py``), the names a test file of it may have: ``test_pkg_x.py``, its
    folder's ``test_pkg.py`` (for ``pkg/__init__.py``: only that), or ``test_x.py`` where no other module or folder of
    ``package`` is named ``x``; a root module ``x.py``: ``test_x.py``."""
    modules = sorted(package.rglob("*.py"))
    folders = {path.parent for path in modules if path.parent != package}
    names = Counter([folder.name for folder in folders] + [path.stem for path in modules if path.stem != "__init__"])
    named = {}
    for path in modules:
        *parents, stem = path.relative_to(package).with_suffix("").parts
        if stem == "__init__":
            stem = parents.pop() if parents else package.name
        own = [*parents, stem]
        accepted = {"_".join(own[:depth]) for depth in range(1, len(own) + 1)}  # its own name, or a folder's
        if names[stem] == 1:
            accepted.add(stem)
        named[path.relative_to(package).as_posix()] = {f"test_{name}.py" for name in accepted}
    return named


def untested_modules(package: Path, tests: Path, min_lines: int = TESTED_LINES) -> list[str]:
    """The modules of ``package`` of ``min_lines`` lines or more with no test file in ``tests`` named after them."""
    present = {path.name for path in tests.glob("test_*.py")}
    return [
        module
        for module, names in acceptable_test_files(package).items()
        if len((package / module).read_text().splitlines()) >= min_lines and not names & present
    ]


def test_every_module_of_some_size_has_a_test_file_named_after_it():
    assert untested_modules(PACKAGE, Path(__file__).resolve().parent) == []


def test_the_check_finds_a_module_without_its_test_file(tmp_path):
    package, tests = tmp_path / "package", tmp_path / "tests"
    for folder in ("ppo", "reward", "data"):
        (package / folder).mkdir(parents=True)
    long = "x = 1\n" * 5
    for module in ("ppo/trainer.py", "reward/trainer.py", "ppo/rollouts.py", "data/__init__.py", "models.py"):
        (package / module).write_text(long)
    (package / "ppo" / "short.py").write_text("x = 1\n")
    tests.mkdir()
    for name in ("test_trainer.py", "test_reward.py", "test_rollouts.py", "test_models.py"):
        (tests / name).write_text("")
    # test_trainer.py names neither trainer (two modules have that name); the reward folder's file covers its own
    assert untested_modules(package, tests, min_lines=5) == ["data/__init__.py", "ppo/trainer.py"]
    assert acceptable_test_files(package)["ppo/rollouts.py"] == {
        "test_ppo.py",
        "test_ppo_rollouts.py",
        "test_rollouts.py",
    }
    assert acceptable_test_files(package)["data/__init__.py"] == {"test_data.py"}


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


def test_every_public_name_of_every_package_resolves():
    """Each package's ``__all__`` names resolve, the lazily imported ones too (a module renamed under a lazy map fails
    here, not in a user's first import)."""
    import importlib

    for init in sorted(PACKAGE.rglob("__init__.py")):
        name = ".".join(init.parent.relative_to(PACKAGE.parent).parts)
        module = importlib.import_module(name)
        missing = [item for item in getattr(module, "__all__", []) if not hasattr(module, item)]
        assert missing == [], f"{name}: {missing}"
