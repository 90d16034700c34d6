"""The package's shape: no import cycle, no module over 500 lines, components never import recipes, a public API."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "automodel_ckpt"
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _module_level_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``name`` imports when it is imported (imports inside functions are lazy)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in known)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    found.add(target if target in known else base)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):  # module-level blocks run at import
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))

    visit(tree.body)
    return {m for m in found if m in known and m != name}


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _module_level_imports(name, path, set(modules)) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name)


def test_the_cycle_finder_sees_a_cycle(tmp_path):
    (tmp_path / "a.py").write_text("from automodel_ckpt import b\n")
    assert _module_level_imports("automodel_ckpt.a", tmp_path / "a.py", {"automodel_ckpt.a", "automodel_ckpt.b"}) == {
        "automodel_ckpt.b"}
    (tmp_path / "c.py").write_text("def f():\n    from automodel_ckpt import b\n")
    assert _module_level_imports("automodel_ckpt.c", tmp_path / "c.py", {"automodel_ckpt.b"}) == set()


def test_no_module_over_500_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"split these by responsibility: {long}"


def test_every_module_opens_with_a_docstring():
    missing = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
               if not ast.get_docstring(ast.parse(p.read_text(encoding="utf-8")))]
    assert missing == []


def test_components_never_import_recipes():
    modules = _modules()
    offenders = []
    for name, path in modules.items():
        if name.startswith(("automodel_ckpt.recipes", "automodel_ckpt.cli")):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):  # lazy imports count too
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.startswith("automodel_ckpt.recipes") for n in names):
                offenders.append(name)
    assert offenders == []


def test_public_checkpoint_api():
    from automodel_ckpt.checkpoint import CheckpointConfig, Checkpointer, HFArtifacts, SaveInfo, discover_state

    import automodel_ckpt.checkpoint as checkpoint

    assert all(callable(x) for x in (CheckpointConfig, Checkpointer, HFArtifacts, SaveInfo, discover_state))
    assert {"Checkpointer", "CheckpointConfig", "SaveInfo", "HFArtifacts", "discover_state"} <= set(checkpoint.__all__)
    for name in checkpoint.__all__:
        assert getattr(checkpoint, name) is not None
    with pytest.raises(AttributeError):
        checkpoint.NoSuchThing  # noqa: B018


def test_public_recipe_base():
    from automodel_ckpt.recipes import BaseRecipe
    from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe

    assert "BaseRecipe" in importlib.import_module("automodel_ckpt.recipes").__all__
    assert issubclass(FinetuneRecipe, BaseRecipe)
    with pytest.raises(NotImplementedError):
        BaseRecipe.run(object.__new__(BaseRecipe))


def test_the_export_and_cli_packages_exist_and_the_old_module_path_still_resolves():
    for name in ("automodel_ckpt.cli", "automodel_ckpt.checkpoint.export", "automodel_ckpt.checkpoint.export.plan",
                 "automodel_ckpt.checkpoint.consolidate_cli"):
        assert importlib.util.find_spec(name) is not None, name
