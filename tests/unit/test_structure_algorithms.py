"""The algorithm seam: algorithms read a narrow context (never the recipe), the base is a contract, losses return
their metric sums, each algorithm overrides few hooks and is one folder whose section the config learns from its
registry. Each rule is shown to see a planted violation."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "automodel_ckpt"
ALGORITHMS = PACKAGE / "algorithms"
MAX_HOOKS = 10
MAX_CONTEXT_ATTRIBUTES = 8


def _algorithm_modules() -> dict[str, Path]:
    return {"automodel_ckpt." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts): p
            for p in sorted(ALGORITHMS.rglob("*.py")) if p.stem != "__init__"}


def _hooks() -> set[str]:
    from automodel_ckpt.algorithms.base import Algorithm

    return {name for name, value in vars(Algorithm).items() if not name.startswith("_") and callable(value)}


def overridden_hooks(cls: type, hooks: set[str]) -> list[str]:
    """The hooks of the contract that ``cls`` defines itself."""
    return sorted(name for name in vars(cls) if name in hooks)


def test_each_algorithm_overrides_at_most_ten_hooks():
    from automodel_ckpt.algorithms.base import Algorithm

    hooks = _hooks()
    found = {}
    for name in _algorithm_modules():
        for _, cls in inspect.getmembers(importlib.import_module(name), inspect.isclass):
            if issubclass(cls, Algorithm) and cls is not Algorithm and cls.__module__ == name:
                found[cls.__name__] = overridden_hooks(cls, hooks)
    assert {"Supervised", "Preference", "GRPO"} <= set(found)
    assert {k: v for k, v in found.items() if len(v) > MAX_HOOKS} == {}
    planted = hooks | {f"hook_{i}" for i in range(MAX_HOOKS + 1 - len(hooks))}  # a base of 11 hooks, all replaced
    many = type("Many", (Algorithm,), {h: lambda self: None for h in sorted(planted)})
    assert len(overridden_hooks(many, planted)) == MAX_HOOKS + 1


def test_the_base_algorithm_is_a_contract_with_no_behaviour():
    """Every hook of ``Algorithm`` raises ``NotImplementedError`` or returns a constant (None, {}): no loss, no
    data, no step of its own."""
    source = (ALGORITHMS / "base.py").read_text(encoding="utf-8")
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Algorithm")
    assert behaviour(cls) == []
    planted = ast.parse("class Algorithm:\n    def loss_count(self, mb):\n        return mb.labels.sum()\n").body[0]
    assert behaviour(planted) == ["loss_count"]


def behaviour(cls: ast.ClassDef) -> list[str]:
    """The public methods of a class whose body does more than a docstring, ``raise NotImplementedError``, ``pass``
    or ``return`` a constant or an empty mapping."""
    out = []
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
            continue
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        for s in body:
            plain = isinstance(s, ast.Pass) or (isinstance(s, ast.Raise) and "NotImplementedError" in ast.unparse(s)) \
                or (isinstance(s, ast.Return) and (s.value is None or isinstance(s.value, ast.Constant)
                                                   or ast.unparse(s.value) == "{}"))
            if not plain:
                out.append(fn.name)
                break
    return out


def context_reads(source: str) -> tuple[set[str], list[str]]:
    """What a module reads of its context (``ctx.X`` or ``self.ctx.X``), and where it reads the recipe."""
    reads, recipe = set(), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id == "recipe":
            recipe.append(f"line {node.lineno}: recipe")
        elif isinstance(node, ast.Attribute):
            if node.attr == "recipe":
                recipe.append(f"line {node.lineno}: .recipe")
            value = node.value
            if (isinstance(value, ast.Name) and value.id == "ctx") or \
                    (isinstance(value, ast.Attribute) and value.attr == "ctx"):
                reads.add(node.attr)
    return reads, recipe


def test_algorithms_read_a_narrow_context_and_never_the_recipe():
    reads, recipe = set(), {}
    for name, path in _algorithm_modules().items():
        if name.endswith(".context"):
            continue
        got, where = context_reads(path.read_text(encoding="utf-8"))
        reads |= got
        if where:
            recipe[name] = where
    assert recipe == {}
    assert len(reads) <= MAX_CONTEXT_ATTRIBUTES, sorted(reads)
    from automodel_ckpt.algorithms.context import TrainContext

    assert reads <= set(TrainContext.__dataclass_fields__)
    got, where = context_reads("def f(self):\n    self.recipe.dims\n    recipe._logits(1)\n    self.ctx.model\n")
    assert got == {"model"} and where == ["line 2: .recipe", "line 3: recipe"]


def side_lists(source: str) -> list[str]:
    """Where a module names ``_calls`` (a side list of each loss call's numbers)."""
    return [f"line {n.lineno}" for n in ast.walk(ast.parse(source))
            if (isinstance(n, ast.Attribute) and n.attr == "_calls") or (isinstance(n, ast.Name) and n.id == "_calls")]


def test_losses_return_their_metric_sums_no_side_lists():
    offenders = {str(p.relative_to(PACKAGE)): side_lists(p.read_text(encoding="utf-8")) for p in PACKAGE.rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert side_lists("self._calls.append(sums)\n") == ["line 1"]


def test_grpo_builds_no_supervised_data():
    """GRPO's loader is its prompts' (``PromptLoader``): no supervised rows built beside it."""
    source = (ALGORITHMS / "grpo" / "algorithm.py").read_text(encoding="utf-8")
    assert [word for word in ("super().build_data", "supervised_data", "prepare_data") if word in source] == []


def dataset_instantiations(source: str) -> list[str]:
    """Where a module instantiates a dataset section (``instantiate(cfg.dataset, ...)``, ``"validation_dataset"``)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "instantiate":
            if any("dataset" in ast.unparse(a) for a in node.args[:2]):
                out.append(f"line {node.lineno}")
    return out


def test_the_dataset_is_instantiated_only_in_data():
    offenders = {str(p.relative_to(PACKAGE)): dataset_instantiations(p.read_text(encoding="utf-8"))
                 for p in PACKAGE.rglob("*.py") if not p.is_relative_to(PACKAGE / "data")}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert dataset_instantiations("rows = instantiate(self.ctx.cfg.dataset, 'dataset')\n") == ["line 1"]
    assert dataset_instantiations("model = instantiate(cfg.model, 'model')\n") == []


# --- one folder per algorithm: the schema, its checks and preview learn each section from ``config.sections`` ------

NAMELESS = [PACKAGE / "config" / "schema.py", PACKAGE / "config" / "validate.py", PACKAGE / "config" / "stages.py",
            PACKAGE / "cli" / "preview.py"]


def algorithm_names(source: str, names: set[str]) -> list[str]:
    """Where ``source`` (docstrings and comments too) names an algorithm: one of ``names`` as a word, any case."""
    words = re.compile(r"\b(" + "|".join(sorted(names)) + r")", re.IGNORECASE)
    return [f"line {i}: {m.group(0)}" for i, line in enumerate(source.splitlines(), start=1)
            for m in words.finditer(line)]


def test_the_schema_its_checks_and_preview_name_no_algorithm():
    import automodel_ckpt.algorithms  # noqa: F401 - registers the sections
    from automodel_ckpt.config.sections import registered

    folders = {p.name for p in ALGORITHMS.iterdir() if (p / "__init__.py").is_file()}
    assert {"dpo", "grpo", "sft"} <= folders
    assert {s.name for s in registered()} == {"dpo", "grpo"}
    names = folders | {s.name for s in registered()} | {"preference"}
    offenders = {str(p.relative_to(PACKAGE)): algorithm_names(p.read_text(encoding="utf-8"), names) for p in NAMELESS}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert algorithm_names('if cfg.get("dpo") is not None:  # Preference pairs\n', names) == [
        "line 1: dpo", "line 1: Preference"]


def test_each_algorithm_is_its_folder_and_its_section_one_register_line():
    """``algorithms/`` holds the contract and one folder per algorithm; each section is registered by one line of
    ``algorithms/__init__.py``."""
    loose = sorted(p.name for p in ALGORITHMS.glob("*.py"))
    assert loose == ["__init__.py", "base.py", "context.py"]
    lines = (ALGORITHMS / "__init__.py").read_text(encoding="utf-8").splitlines()
    assert [line for line in lines if line.startswith("register_section(")] == [
        "register_section(_DPO)", "register_section(_GRPO)"]
