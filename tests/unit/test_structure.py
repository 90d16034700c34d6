"""The package's shape: no import cycle (lazy imports included), no module over 500 lines, the package under its size
ceiling, components never import recipes, a public API, and every pickle read from a checkpoint goes through
``ondisk/formats/safe_load.py``."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "automodel_ckpt"
MAX_LINES = 500


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``name`` imports anywhere: at module level, inside functions and methods, under
    ``if TYPE_CHECKING`` (a lazy import is still a dependency: it only moves the cycle's failure to run time)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in known else base)
    return {m for m in found if m in known and m != name}


def _import_graph(root: Path) -> dict[str, set[str]]:
    modules = _modules(root)
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (``[a, b, ..., a]``), or None when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = walk(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            found = walk(name)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = find_cycle(_import_graph(PACKAGE))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    package = tmp_path / "automodel_ckpt"
    (package / "room").mkdir(parents=True)
    (package / "__init__.py").write_text('"""Planted."""\n')
    (package / "room" / "__init__.py").write_text('"""Planted."""\n')
    (package / "room" / "a.py").write_text("from automodel_ckpt.room import b\n")
    (package / "room" / "b.py").write_text("def f():\n    from automodel_ckpt.room.a import g\n")
    assert find_cycle(_import_graph(package)) == ["automodel_ckpt.room.a", "automodel_ckpt.room.b",
                                                  "automodel_ckpt.room.a"]
    (package / "room" / "b.py").write_text("def f():\n    import json\n")  # the cycle removed: none found
    assert find_cycle(_import_graph(package)) is None
    (package / "room" / "b.py").write_text("def f():\n    from . import a\n")  # relative, inside a function
    assert find_cycle(_import_graph(package)) is not None


def test_no_module_over_500_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"split these by responsibility: {long}"


#: The package's size in lines (``find automodel_ckpt -name '*.py' | xargs cat | wc -l``), with stages, the vLLM
#: engine, the DeepSpeed and torchtitan imports and the run report: a ceiling (the limit of 41k) that new features
#: pay for by merging.
PACKAGE_LINES_MAX = 41_000


def package_lines(root: Path = PACKAGE) -> int:
    """The lines of every module below ``root``, as ``wc -l`` counts them."""
    return sum(p.read_bytes().count(b"\n") for p in root.rglob("*.py"))


def test_the_package_stays_under_its_size_ceiling(tmp_path):
    lines = package_lines()
    assert lines <= PACKAGE_LINES_MAX, (f"the package is {lines:,} lines, over its ceiling of {PACKAGE_LINES_MAX:,}; "
                                        "merge what repeats before adding more")
    (tmp_path / "inner").mkdir()
    (tmp_path / "a.py").write_text("x = 1\ny = 2\n")
    (tmp_path / "inner" / "b.py").write_text("z = 3\n")
    (tmp_path / "notes.md").write_text("not code\n")
    assert package_lines(tmp_path) == 3  # over a ceiling of 2: the rule sees it


def test_every_module_opens_with_a_docstring():
    missing = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
               if not ast.get_docstring(ast.parse(p.read_text(encoding="utf-8")))]
    assert missing == []


def test_every_module_docstring_opens_with_one_line():
    """The first line says what the module owns, alone: a blank line (or nothing) follows it."""
    wrapped = []
    for p in PACKAGE.rglob("*.py"):
        lines = (ast.get_docstring(ast.parse(p.read_text(encoding="utf-8")), clean=False) or "").splitlines()
        if len(lines) > 1 and lines[1].strip():
            wrapped.append(str(p.relative_to(PACKAGE.parent)))
    assert wrapped == [], f"make the first docstring line one line: {wrapped}"


LAYOUT = PACKAGE / "ondisk" / "layout.py"


def checkpoint_file_names() -> set[str]:
    """The file and pointer names ``disk/layout.py`` spells (its module-level string constants that name files)."""
    names = set()
    for node in ast.parse(LAYOUT.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            value = node.value.value
            if "." in value.strip(".") or value.isupper():
                names.add(value)
    return names


def spelled_names(source: str, names: set[str]) -> list[str]:
    """String literals of ``source`` (docstrings aside) that spell one of ``names``."""
    tree = ast.parse(source)
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [f"line {n.lineno}: {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names and id(n) not in docs]


def test_layout_alone_spells_checkpoint_file_names():
    """Outside ``disk/layout.py`` a checkpoint's file names come from it (``models/`` spells the files of a base
    model's Hugging Face folder, which is not a checkpoint)."""
    names = checkpoint_file_names()
    assert {"manifest.json", "metadata.json", "LATEST", ".run.lock"} <= names
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in (LAYOUT, PACKAGE / "ondisk" / "__init__.py") or path.is_relative_to(PACKAGE / "models"):
            continue  # the face's table holds layout's names (LATEST), not files
        found = spelled_names(path.read_text(encoding="utf-8"), names)
        if found:
            offenders[str(path.relative_to(PACKAGE.parent))] = found
    assert offenders == {}, f"name these files through ondisk/layout.py: {offenders}"
    assert spelled_names('"""manifest.json is named here."""\nNAME = "manifest.json"\n', names) == [
        "line 2: 'manifest.json'"]


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


def _imported_names(path: Path) -> list[str]:
    """Every module a file imports, lazy imports included."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


def test_the_object_store_is_private_to_storage():
    """Verbs, the recipe and the rest of ``checkpoint/`` reach run folders through ``checkpoint.storage`` only."""
    private = "automodel_ckpt.checkpoint.objectstore"
    offenders = sorted(
        name for name, path in _modules().items()
        if not name.startswith(("automodel_ckpt.checkpoint.storage", private))
        and any(n == private or n.startswith(private + ".") for n in _imported_names(path))
    )
    assert offenders == []


def test_the_privacy_rule_sees_a_lazy_import(tmp_path):
    module = tmp_path / "verb.py"
    module.write_text("def main():\n    from automodel_ckpt.checkpoint import objectstore\n")
    assert "automodel_ckpt.checkpoint.objectstore" in _imported_names(module)


# --- the checkpoint folder's bytes (ondisk) under the exports (export) under the engine (checkpoint): a face each ---

FACES = ("automodel_ckpt.ondisk", "automodel_ckpt.export", "automodel_ckpt.checkpoint")
REPO = PACKAGE.parent
# the packages whose code may import a face's modules past it: its own, and for ondisk the engine that writes it
# (the exports enter ondisk by its face, as every other room does)
ADMITS = {"automodel_ckpt.ondisk": ("ondisk", "checkpoint"), "automodel_ckpt.export": ("export",),
          "automodel_ckpt.checkpoint": ("checkpoint",)}
# the names outside code needs from the checkpoint folder's face (issue #78: 108 before; 44 while the exports went
# past it; 91 with what the exports need: safetensors I/O, the family's layout, durable writes, the manifest's verdicts;
# 97 since the layout's table became its five folder objects and two sibling builders)
ONDISK_FACE_MAX = 97
TIMES_INTERNALS = "Times internals:"


def declared_internals(source: str) -> tuple[str, ...]:
    """The packages or modules (``ondisk.formats``) that a benchmark's docstring names on its one line starting
    ``Times internals:``, as full module names: a benchmark that times the insides of a face imports them directly."""
    doc = ast.get_docstring(ast.parse(source)) or ""
    lines = [line for line in doc.splitlines() if line.startswith(TIMES_INTERNALS)]
    assert len(lines) <= 1, "say it in one line"
    return tuple(f"automodel_ckpt.{name}" for name in re.findall(r"``([a-z_.]+)``", lines[0])) if lines else ()


def past_the_faces(source: str, faces: dict[str, set[str]], *, tool: bool) -> list[str]:
    """``imports_past_the_faces``, less the imports of what a benchmark (``tool``: a file of ``tools/``) declares it
    times."""
    found = imports_past_the_faces(source, faces)
    inside = declared_internals(source) if tool else ()
    return [o for o in found if not any(re.search(rf"(from|import) {re.escape(m)}(\.| |$)", o) for m in inside)]


def _past_the_faces(path: Path, faces: dict[str, set[str]]) -> list[str]:
    return past_the_faces(path.read_text(encoding="utf-8"), faces, tool=path.is_relative_to(REPO / "tools"))


def _face_names() -> dict[str, set[str]]:
    return {face: set(importlib.import_module(face).__all__) for face in FACES}


def imports_past_the_faces(source: str, faces: dict[str, set[str]]) -> list[str]:
    """Imports in ``source`` (lazy ones included) of a module inside ``FACES``' packages, or of a name that a face
    does not export."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [f"line {node.lineno}: import {a.name}" for a in node.names
                    if any(a.name.startswith(face + ".") for face in faces)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in faces:
                out += [f"line {node.lineno}: {a.name} is not in {node.module}.__all__" for a in node.names
                        if a.name not in faces[node.module]]
            elif any(node.module.startswith(face + ".") for face in faces):
                out.append(f"line {node.lineno}: from {node.module} import ...")
    return out


def _faces_held_to(path: Path, faces: dict[str, set[str]]) -> dict[str, set[str]]:
    """The faces that the code of ``path`` enters by: those whose modules its package may not import."""
    room = path.relative_to(PACKAGE).parts[0] if path.is_relative_to(PACKAGE) else None
    return {face: names for face, names in faces.items() if room not in ADMITS[face]}


def test_code_imports_the_three_packages_through_their_faces():
    faces = _face_names()
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")) + sorted((REPO / "tools").rglob("*.py")) + \
            sorted((REPO / "examples").rglob("*.py")):
        found = _past_the_faces(path, _faces_held_to(path, faces))
        if found:
            offenders[str(path.relative_to(REPO))] = found
    assert offenders == {}, f"import these through the faces {FACES}: {offenders}"
    assert _faces_held_to(PACKAGE / "checkpoint" / "save" / "policy.py", faces).keys() == {"automodel_ckpt.export"}


def test_the_exports_enter_ondisk_by_its_face():
    """``export/`` imports no ``ondisk`` module past ``ondisk/__init__.py``'s ``__all__``: what the exports need of a
    folder's bytes is on the face, which is their contract with it (``test_code_imports_the_three_packages_through_
    their_faces`` holds every module of ``export/`` to it)."""
    faces = _face_names()
    assert "automodel_ckpt.ondisk" in _faces_held_to(PACKAGE / "export" / "archive.py", faces)
    offenders = {str(p.relative_to(REPO)): found for p in sorted((PACKAGE / "export").glob("*.py"))
                 if (found := _past_the_faces(p, {"automodel_ckpt.ondisk": faces["automodel_ckpt.ondisk"]}))}
    assert offenders == {}
    planted = "from automodel_ckpt.ondisk import RunFolder\nfrom automodel_ckpt.ondisk.durable import fsync_dir\n"
    assert imports_past_the_faces(planted, {"automodel_ckpt.ondisk": {"RunFolder"}}) == [
        "line 2: from automodel_ckpt.ondisk.durable import ..."]


def test_the_face_rule_sees_each_way_past_a_face():
    faces = {"automodel_ckpt.ondisk": {"layout"}, "automodel_ckpt.checkpoint": {"Checkpointer"}}
    for source in ("from automodel_ckpt.ondisk.catalog import scan\n",
                   "def f():\n    import automodel_ckpt.checkpoint.save.writer\n",
                   "from automodel_ckpt.checkpoint import storage\n"):
        assert imports_past_the_faces(source, faces), source
    assert imports_past_the_faces("from automodel_ckpt.ondisk import layout\nfrom automodel_ckpt.checkpoint import "
                                  "Checkpointer\nimport automodel_ckpt.checkpoint\n", faces) == []


def test_the_checkpoint_folders_bytes_never_import_the_exports_or_the_engine():
    """``ondisk`` (layout, manifest, formats: the contract with checkpoints on disk) is below ``export`` (Hugging
    Face folders, archives, GGUF, int8), both below ``checkpoint`` (the engine that writes and reads them): no import
    upwards from either, lazy ones included."""
    above = {"ondisk": ("automodel_ckpt.export", "automodel_ckpt.checkpoint"), "export": ("automodel_ckpt.checkpoint",)}
    offenders = {str(p.relative_to(REPO)): names for room, higher in above.items()
                 for p in (PACKAGE / room).rglob("*.py")
                 if (names := [n for n in _imported_names(p) if any(n == h or n.startswith(h + ".") for h in higher)])}
    assert offenders == {}


@pytest.mark.parametrize("face", ["automodel_ckpt.ondisk", "automodel_ckpt.export"])
def test_a_face_names_members_never_whole_modules(face):
    """Outside code names the members it uses: each entry of the face is a member of a module below it, and no name
    of the face is a module's (importing that module would put the module in the member's place)."""
    import types

    module = importlib.import_module(face)
    assert [n for n, (_, attr) in module._EXPORTS.items() if attr is None] == []
    assert [n for n in module.__all__ if isinstance(getattr(module, n), types.ModuleType)] == []
    folder = PACKAGE / face.rpartition(".")[2]
    assert [n for n in module.__all__ if (folder / f"{n}.py").exists() or (folder / n).is_dir()] == []


def test_no_name_is_exported_by_two_faces_and_no_face_renames_a_name():
    """A name has one face, and each face hands its members on under their own names."""
    owners: dict[str, list[str]] = {}
    for face, names in _face_names().items():
        for name in names:
            owners.setdefault(name, []).append(face)
    assert {n: faces for n, faces in owners.items() if len(faces) > 1} == {}
    for face in FACES:
        module = importlib.import_module(face)
        assert [n for n, (_, attr) in module._EXPORTS.items() if attr != n] == [], face
        assert [n for n in module.__all__ if getattr(getattr(module, n), "__name__", n) != n] == [], face


def _outside_code() -> list[Path]:
    """The files that enter ``ondisk`` by its face: the package outside it and the engine (the exports included), the
    tools, the examples."""
    inside = [PACKAGE / room for room in ADMITS["automodel_ckpt.ondisk"]]
    return [p for p in sorted(PACKAGE.rglob("*.py")) if not any(p.is_relative_to(r) for r in inside)] + \
        sorted((REPO / "tools").rglob("*.py")) + sorted((REPO / "examples").rglob("*.py"))


def test_the_ondisk_face_is_what_outside_code_needs():
    """At most ``ONDISK_FACE_MAX`` names, each imported by code outside ``ondisk`` and the engine. The layout's files
    reach outside code only as folder objects (``folders``: ``CheckpointFolder(ck).model.consolidated.config``): no
    name of the face is ``layout``'s, no outside code reads a table of its names (``LAYOUT``), and every file of a
    folder object is a name ``layout`` spells."""
    from automodel_ckpt.ondisk import folders, layout

    ondisk = importlib.import_module("automodel_ckpt.ondisk")
    assert len(ondisk.__all__) <= ONDISK_FACE_MAX, len(ondisk.__all__)
    assert [n for n, (module, _) in ondisk._EXPORTS.items() if module == "layout"] == []
    spelled = {v for v in vars(layout).values() if isinstance(v, str)}
    entries = {(c.__name__, k): e.name for c in vars(folders).values() if isinstance(c, type)
               for k, e in vars(c).items() if isinstance(e, folders._Entry)}
    assert len(entries) > 30 and {k: n for k, n in entries.items() if n not in spelled} == {}
    imported, tables = set(), []
    for path in _outside_code():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "automodel_ckpt.ondisk":
                imported |= {a.name for a in node.names}
            elif isinstance(node, ast.Name) and node.id == "LAYOUT":
                tables.append(str(path.relative_to(REPO)))
    assert set(ondisk.__all__) - imported == set(), "no outside code needs these: leave them to the modules"
    assert tables == [], "name the layout's files through the folder objects (ondisk/folders.py)"


def test_a_benchmark_that_times_internals_says_so_in_one_line():
    faces = {"automodel_ckpt.ondisk": {"RunFolder"}}
    source = '"""Times the planner.\n\nTimes internals: imports ``ondisk.saveplan`` directly.\n"""\n' \
             "from automodel_ckpt.ondisk.saveplan.planning import LinearSavePlanner\n"
    assert declared_internals(source) == ("automodel_ckpt.ondisk.saveplan",)
    assert imports_past_the_faces(source, faces)  # past the face, admitted only by the line
    assert past_the_faces(source, faces, tool=True) == []
    assert past_the_faces(source.replace("``ondisk.saveplan``", "``ondisk.manifest``"), faces, tool=True) != []
    assert past_the_faces(source.replace("ondisk.saveplan``", "ondisk.saveplanx``"), faces, tool=True) != []
    assert past_the_faces(source, faces, tool=False) != []  # outside tools/ the line admits nothing


def test_each_face_exports_what_it_lists_and_the_public_names_stay_few():
    """A face's ``__all__`` is its table of names, each resolves; the three packages' public names (everything else
    is private to them by the face rule above) stay at most 200."""
    public = set()
    for face in FACES:
        module = importlib.import_module(face)
        assert sorted(module.__all__) == sorted(module._EXPORTS)
        for name in module.__all__:
            assert getattr(module, name) is not None, f"{face}.{name}"
        with pytest.raises(AttributeError):
            getattr(module, "no_such_name")
        public |= {f"{face}.{name}" for name in module.__all__}
    assert len(public) <= 200, len(public)


def test_the_checkpointer_reads_top_to_bottom():
    """At most 300 lines, no nested functions or lambdas standing in for objects, lines within 120 characters."""
    path = PACKAGE / "checkpoint" / "checkpointer.py"
    source = path.read_text(encoding="utf-8")
    assert len(source.splitlines()) <= 300
    assert max(len(line) for line in source.splitlines()) <= 120
    tree = ast.parse(source)
    nested = [n.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
              for n in ast.walk(f) if n is not f and isinstance(n, (ast.FunctionDef, ast.Lambda))
              and hasattr(n, "name")]
    lambdas = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Lambda)]
    assert nested == [] and lambdas == []


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
    for name in ("automodel_ckpt.cli", "automodel_ckpt.export", "automodel_ckpt.export.plan",
                 "automodel_ckpt.checkpoint.consolidate_cli"):
        assert importlib.util.find_spec(name) is not None, name
    assert importlib.util.find_spec("automodel_ckpt.ondisk.export") is None  # exports are a package of their own


# --- every pickle from a checkpoint goes through ondisk/formats/safe_load.py -------------------------------

SAFE_LOAD = PACKAGE / "ondisk" / "formats" / "safe_load.py"
_DCP = "torch.distributed.checkpoint"
# torch names that read a checkpoint's pickles with torch's own (unrestricted) reader or planner
_PLAIN_DCP_READERS = {"FileSystemReader", "FsspecReader", "dcp_to_torch_save", "torch_save_to_dcp",
                      "BroadcastingTorchSaveReader", "DynamicMetaLoadPlanner", "_load_state_dict_from_keys"}


def unsafe_loads(source: str) -> list[str]:
    """Places in ``source`` that could unpickle untrusted bytes other than through ``safe_load``: ``pickle.load``,
    ``pickle.loads`` and ``pickle.Unpickler`` (however imported), ``torch.load`` without ``weights_only=True``,
    torch's plain DCP readers, a ``read_metadata`` of one's own, and ``dcp.load`` without our reader and planner."""
    tree = ast.parse(source)
    pickle_mods, torch_mods, dcp_mods, bad_names = {"pickle", "_pickle", "cPickle"}, {"torch"}, set(), {}
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                local = a.asname or a.name.split(".")[0]
                if a.name in ("pickle", "_pickle", "cPickle", "dill", "cloudpickle"):
                    pickle_mods.add(local)
                if a.name == "torch":
                    torch_mods.add(local)
                if a.name == _DCP and a.asname:
                    dcp_mods.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            for a in node.names:
                local = a.asname or a.name
                if module in ("pickle", "_pickle", "dill", "cloudpickle") and a.name in ("load", "loads", "Unpickler"):
                    bad_names[local] = f"{module}.{a.name}"
                elif module in ("torch", "torch.serialization") and a.name == "load":
                    bad_names[local] = f"{module}.load"
                elif module.startswith(_DCP) and a.name in _PLAIN_DCP_READERS:
                    out.append(f"line {node.lineno}: imports torch's plain {a.name}")
                elif module == "torch.distributed" and a.name == "checkpoint":
                    dcp_mods.add(local)
                elif module.startswith(_DCP) and a.name == "load":
                    bad_names[local] = "dcp.load"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner, attr = node.value.id, node.attr
            if owner in pickle_mods and attr in ("load", "loads", "Unpickler", "_Unpickler"):
                out.append(f"line {node.lineno}: {owner}.{attr}")
            if attr in _PLAIN_DCP_READERS:
                out.append(f"line {node.lineno}: {owner}.{attr}")
        elif isinstance(node, ast.Name) and node.id in bad_names and bad_names[node.id] != "torch.load" \
                and bad_names[node.id] != "dcp.load":
            out.append(f"line {node.lineno}: {bad_names[node.id]}")
        elif isinstance(node, ast.ClassDef) and any(isinstance(f, ast.FunctionDef) and f.name == "read_metadata"
                                                    for f in node.body):
            out.append(f"line {node.lineno}: class {node.name} reads DCP metadata itself (read_metadata)")
        if not isinstance(node, ast.Call):
            continue
        func, keywords = node.func, {k.arg: k.value for k in node.keywords}
        dotted = ast.unparse(func)
        is_torch_load = (isinstance(func, ast.Attribute) and func.attr == "load" and isinstance(func.value, ast.Name)
                         and func.value.id in torch_mods) or dotted in ("torch.serialization.load",) or \
            (isinstance(func, ast.Name) and bad_names.get(func.id) == "torch.load")
        if is_torch_load:
            flag = keywords.get("weights_only")
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                out.append(f"line {node.lineno}: {dotted} without weights_only=True")
        is_dcp_load = (isinstance(func, ast.Attribute) and func.attr == "load" and isinstance(func.value, ast.Name)
                       and func.value.id in dcp_mods) or dotted in (f"{_DCP}.load",) or \
            (isinstance(func, ast.Name) and bad_names.get(func.id) == "dcp.load")
        if is_dcp_load and not {"storage_reader", "planner"} <= set(keywords):
            out.append(f"line {node.lineno}: {dotted} without storage_reader= and planner= (torch's plain reader)")
    return sorted(set(out))


def test_every_pickle_is_read_by_safe_load():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == SAFE_LOAD:
            continue
        found = unsafe_loads(path.read_text(encoding="utf-8"))
        if found:
            offenders[str(path.relative_to(PACKAGE.parent))] = found
    assert offenders == {}, f"read pickles from checkpoints only through ondisk/formats/safe_load.py: {offenders}"


@pytest.mark.parametrize("source", [
    "import pickle\npickle.load(f)\n",
    "import pickle as p\np.loads(b)\n",
    "from pickle import loads\nloads(b)\n",
    "import pickle\nclass U(pickle.Unpickler):\n    pass\n",
    "import torch\ntorch.load(f)\n",
    "import torch\ntorch.load(f, weights_only=False)\n",
    "from torch import load\nload(f, weights_only=flag)\n",
    "from torch.distributed.checkpoint import FileSystemReader\nFileSystemReader(p).read_metadata()\n",
    "import torch.distributed.checkpoint as dcp\ndcp.FileSystemReader(p)\n",
    "import torch.distributed.checkpoint as dcp\ndcp.load(state, checkpoint_id=p)\n",
    "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n",
    "class R:\n    def read_metadata(self):\n        pass\n",
])
def test_the_pickle_rule_sees_each_unsafe_read(source):
    assert unsafe_loads(source), source


def test_the_pickle_rule_accepts_safe_reads():
    ok = ("import torch\nimport torch.distributed.checkpoint as dcp\ntorch.load(f, map_location='cpu', "
          "weights_only=True)\ndcp.load(s, storage_reader=r, planner=p)\nimport pickle\npickle.dumps(x)\n")
    assert unsafe_loads(ok) == []


def test_the_launcher_checks_a_recipe_without_the_training_stack():
    """``ckpt-train RECIPE`` validates the recipe in the launcher before the workers start: it imports neither
    ``datasets`` nor the recipes' training code, which every worker imports anyway (a slower start, a larger
    launcher)."""
    import subprocess
    import sys

    recipe = PACKAGE.parent / "recipes" / "tiny_llama_sft.yaml"
    code = ("import sys\nfrom automodel_ckpt.cli import main\n"
            f"assert main(['--nproc-per-node', '2', {str(recipe)!r}, '--dry-run']) == 0\n"
            "print(sorted(m for m in sys.modules if m == 'datasets' or m.startswith('automodel_ckpt.recipes.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


# --- the recipe side: four calls of the checkpointer, faces only, imports only downwards --------------------------

RECIPE_CHECKPOINTER_CALLS = {"resume", "step_end", "fence", "finalize"}


def checkpointer_members(source: str) -> set[str]:
    """The members of the checkpointer that ``source`` uses: ``self.checkpointer.X`` and ``checkpointer.X``."""
    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "checkpointer") or \
                    (isinstance(owner, ast.Name) and owner.id == "checkpointer"):
                used.add(node.attr)
    return used


def test_a_recipe_makes_four_calls_of_the_checkpointer():
    """restore (``resume``), the step-end call, ``fence`` and ``finalize``: deciding when to save, saving, the cost
    report and the node-local tier's faults are the checkpointer's (``checkpoint/cycle.py``)."""
    used = set()
    for path in [*sorted((PACKAGE / "recipes").glob("*.py")), REPO / "examples" / "custom_recipe.py"]:
        used |= checkpointer_members(path.read_text(encoding="utf-8"))
    assert used <= RECIPE_CHECKPOINTER_CALLS, sorted(used - RECIPE_CHECKPOINTER_CALLS)
    assert len(used) <= 4
    assert checkpointer_members("self.checkpointer.save(s, i)\nc = checkpointer.local_due(3)\n") == {"save",
                                                                                                  "local_due"}


def test_the_example_recipe_is_whole_in_forty_lines():
    """docs/custom-recipes.md's recipe from ``BaseRecipe``: every guarantee in at most 40 lines (the run's wiring,
    preemption, observer, checkpointer, resume and the end, is ``BaseRecipe.run``'s)."""
    source = (REPO / "examples" / "custom_recipe.py").read_text(encoding="utf-8")
    assert len(source.splitlines()) <= 40
    assert "BaseRecipe" in source and "FinetuneRecipe" not in source
    assert f"```python\n{source}```" in (REPO / "docs" / "custom-recipes.md").read_text(encoding="utf-8")


def _recipe_class(path: Path, name: str) -> ast.ClassDef:
    return next(n for n in ast.parse(path.read_text(encoding="utf-8")).body
                if isinstance(n, ast.ClassDef) and n.name == name)


def test_the_preference_recipe_is_an_algorithm_not_a_rewrite_of_the_fine_tune():
    """DPO is an ``Algorithm`` the fine-tune recipe holds (its loss, batches, state and counters): ``DPORecipe``
    overrides at most 6 of ``FinetuneRecipe``'s methods."""
    from automodel_ckpt.recipes.llm_finetune import FinetuneRecipe

    body = _recipe_class(PACKAGE / "recipes" / "dpo.py", "DPORecipe").body
    overrides = [n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and hasattr(FinetuneRecipe, n.name)]
    assert len(overrides) <= 6, overrides


def test_the_fine_tune_setup_is_named_steps():
    """``FinetuneRecipe.setup`` reads as its steps: at most 50 lines; no function of a recipe over 99 lines."""
    setup = next(n for n in _recipe_class(PACKAGE / "recipes" / "llm_finetune.py", "FinetuneRecipe").body
                 if isinstance(n, ast.FunctionDef) and n.name == "setup")
    assert setup.end_lineno - setup.lineno + 1 <= 50
    long = {f"{path.name}:{n.name}": n.end_lineno - n.lineno + 1
            for path in [*sorted((PACKAGE / "recipes").glob("*.py")), REPO / "examples" / "custom_recipe.py"]
            for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 99}
    assert long == {}


def test_code_outside_tracking_imports_only_its_face():
    face = "automodel_ckpt.tracking"
    faces = {face: set(importlib.import_module(face).__all__)}
    offenders = {}
    for path in [p for p in PACKAGE.rglob("*.py") if not p.is_relative_to(PACKAGE / "tracking")] + \
            sorted((REPO / "tools").rglob("*.py")) + sorted((REPO / "examples").rglob("*.py")):
        found = _past_the_faces(path, faces)
        if found:
            offenders[str(path.relative_to(REPO))] = found
    assert offenders == {}, f"import these through automodel_ckpt.tracking: {offenders}"


# the floors of the house, top down: a module imports only its own room and the rooms on floors below it
FLOORS = [
    {"__main__"},
    {"cli", "recipes"},
    {"evaluation", "report", "algorithms"},
    {"data"},
    {"config"},
    {"models", "tracking", "interop"},
    {"training"},
    {"checkpoint"},
    {"export"},
    {"ondisk", "launch"},
    {"distributed"},
    {"errors", "faces", "registry", "sizes", "jsonsafe", "redact", "shown", "model_parts", "__init__"},
]


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def arrows_back_up(graph: dict[str, set[str]]) -> list[str]:
    """Imports (lazy ones included) from a room to another room on its floor or a higher one (rooms not in
    ``FLOORS`` are not judged)."""
    floor = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
    out = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = _room(name), _room(target)
            if a != b and floor.get(a, -1) >= floor.get(b, len(FLOORS)):
                out.append(f"{name} -> {target}")
    return out


def test_no_import_runs_back_up():
    rooms = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").is_file())}
    assert rooms - set().union(*FLOORS) == set(), "place each room of the house on a floor of FLOORS"
    assert arrows_back_up(_import_graph(PACKAGE)) == []
    planted = {"automodel_ckpt.distributed.fsdp": {"automodel_ckpt.models.lora"}}
    assert arrows_back_up(planted) == ["automodel_ckpt.distributed.fsdp -> automodel_ckpt.models.lora"]


def test_code_outside_data_enters_it_through_its_face():
    """``data/`` has one face (``__all__``, names loaded on first use): the rest of the package, the tools and the
    examples import only it (benchmarks that time its insides aside, each saying so)."""
    face = "automodel_ckpt.data"
    module = importlib.import_module(face)
    assert all(getattr(module, name) is not None for name in module.__all__)
    # a face name that is also a submodule's is replaced by the module once that module is imported
    assert [n for n in module.__all__ if (PACKAGE / "data" / f"{n}.py").exists() or (PACKAGE / "data" / n).is_dir()] == []
    faces = {face: set(module.__all__)}
    offenders = {}
    for path in [p for p in PACKAGE.rglob("*.py") if not p.is_relative_to(PACKAGE / "data")] + \
            sorted((REPO / "tools").rglob("*.py")) + sorted((REPO / "examples").rglob("*.py")):
        found = _past_the_faces(path, faces)
        if found:
            offenders[str(path.relative_to(REPO))] = found
    assert offenders == {}, f"import these through automodel_ckpt.data: {offenders}"


# --- model formats are plug-ins: one module each in ondisk/formats/, looked up by name through its registry ---------

FORMATS_DIR = PACKAGE / "ondisk" / "formats"
FORMAT_CONSTANTS = {"SAFETENSORS", "TORCH_SAVE", "ADAPTER_FORMAT"}  # the names' constants, as layout.py once held


def format_name_spellings(source: str, names: set[str]) -> list[str]:
    """Where ``source`` names a model format: a string literal that is exactly a format's name (``"safetensors"``,
    ``"torch_save"``; docstrings aside: a ``.safetensors`` suffix, the ``safetensors`` library or prose are not), or
    one of ``FORMAT_CONSTANTS`` (as a name, an attribute or an imported name)."""
    out = spelled_names(source, names)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in FORMAT_CONSTANTS:
            out.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in FORMAT_CONSTANTS:
            out.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom):
            out += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name in FORMAT_CONSTANTS]
    return out


def test_only_the_formats_and_the_config_schema_spell_a_model_format():
    """A model format is one module of ``ondisk/formats/`` and one line of its registry: outside that package only
    the config schema (``checkpoint.model_save_format``'s built-in values) spells a format's name. Measured: at most
    one such file."""
    from automodel_ckpt.ondisk.formats import registry

    names = set(registry.names(configurable=True))
    assert {"safetensors", "torch_save"} <= names
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(FORMATS_DIR):
            continue
        found = format_name_spellings(path.read_text(encoding="utf-8"), names)
        if found:
            offenders[str(path.relative_to(REPO))] = found
    assert len(offenders) <= 1 and set(offenders) <= {"automodel_ckpt/checkpoint/config.py"}, offenders


def test_the_format_name_rule_sees_names_and_constants_not_suffixes_or_the_library():
    names = {"safetensors", "torch_save"}
    assert format_name_spellings('fmt = "torch_save"\nif x == layout.SAFETENSORS: pass\n', names) == [
        "line 1: 'torch_save'", "line 2: .SAFETENSORS"]
    assert format_name_spellings("from automodel_ckpt.ondisk.layout import TORCH_SAVE\n", names) == [
        "line 1: import TORCH_SAVE"]
    assert format_name_spellings('"""Reads safetensors."""\nimport safetensors\nF = "model.safetensors"\n'
                                 'LIMIT = bounded.SAFETENSORS_HEADER\n', names) == []


def not_formats(folder: Path, beside: tuple[Path, ...]) -> list[str]:
    """The entries of ``folder`` that are no format: a ``fastio`` package, a ``plan*`` module, or a module named as
    one of the packages ``beside`` it (the I/O engine, the save planning)."""
    engine = {p.stem for b in beside for p in b.glob("*.py") if p.stem != "__init__"}
    return sorted(p.name for p in folder.iterdir() if p.name != "__pycache__" and
                  (p.name == "fastio" or p.name.startswith("plan") or (p.suffix == ".py" and p.stem in engine)))


def test_the_formats_package_holds_formats_only():
    """``ondisk/formats/`` holds the byte formats; the I/O engine is ``ondisk/fastio/`` and the planning of DCP saves
    ``ondisk/saveplan/``, each a package of its own beside it."""
    beside = (PACKAGE / "ondisk" / "fastio", PACKAGE / "ondisk" / "saveplan")
    assert all((b / "__init__.py").is_file() for b in beside)
    assert not_formats(FORMATS_DIR, beside) == []


def test_the_formats_rule_sees_the_engine_and_the_planning(tmp_path):
    formats, engine = tmp_path / "formats", tmp_path / "fastio"
    (formats / "fastio").mkdir(parents=True)
    engine.mkdir()
    for path in (formats / "plan_checks.py", formats / "records.py", formats / "safe_load.py", engine / "records.py"):
        path.write_text('"""Planted."""\n')
    assert not_formats(formats, (engine,)) == ["fastio", "plan_checks.py", "records.py"]


# --- export targets are plug-ins: one module each and one register line, looked up by name (issue #93) ------------

GGUF_FILES_MAX = 4  # 17 before; 1 today: the register line


def test_export_dispatches_on_no_target_name():
    """``export --to X`` finds its target in ``export.registry``: no ``args.to ==`` (or ``!=``) chain anywhere, and
    the verb spells no target's name."""
    from automodel_ckpt.export import target_names

    chains = {str(p.relative_to(REPO)): n for p in sorted(PACKAGE.rglob("*.py"))
              if (n := len(re.findall(r"\bargs\.to\s*[!=]=", p.read_text(encoding="utf-8"))))}
    assert chains == {}
    verb = PACKAGE / "cli" / "export.py"
    assert spelled_names(verb.read_text(encoding="utf-8"), set(target_names())) == []


def test_gguf_is_known_to_few_files_outside_its_own():
    """What a GGUF file is lives in ``export/gguf_*`` (``gguf_target`` registers it): the verbs ask the registry
    (``identify``, then the target's ``describe``, ``verify``, ``check``, ``lineage_text``, ``open_tensors``,
    ``beside``), and none of ``export``, ``inspect``, ``verify``, ``diff``, ``pack`` and the lineage readers names the
    format. Counted case-insensitively, docstrings included."""
    outside = files_naming("gguf", PACKAGE, own=PACKAGE / "export", prefix="gguf_")
    assert len(outside) <= GGUF_FILES_MAX, outside
    askers = {f"automodel_ckpt/{m}.py" for m in ("cli/export", "cli/inspect", "cli/verify", "cli/diff",
                                                  "evaluation/diff", "export/archive_pack", "export/lineage",
                                                  "export/lineage_walk")}
    assert not askers & set(outside), outside


def files_naming(word: str, root: Path, *, own: Path, prefix: str) -> list[str]:
    """The modules under ``root`` that spell ``word`` (any case, docstrings included), ``own``'s ``prefix*`` modules
    aside."""
    return sorted(str(p.relative_to(root.parent)) for p in root.rglob("*.py")
                  if not (p.parent == own and p.name.startswith(prefix))
                  and word in p.read_text(encoding="utf-8").lower())


def test_the_gguf_count_sees_a_docstring_and_spares_the_format_s_own_modules(tmp_path):
    package = tmp_path / "automodel_ckpt"
    (package / "export").mkdir(parents=True)
    (package / "export" / "gguf_read.py").write_text('"""Reads GGUF."""\n')
    (package / "export" / "lineage.py").write_text('"""A Gguf file\'s lineage."""\n')
    (package / "cli.py").write_text('"""Nothing of the format."""\n')
    assert files_naming("gguf", package, own=package / "export", prefix="gguf_") == ["automodel_ckpt/export/lineage.py"]


def _is_count_limit(node: ast.AST) -> bool:
    """``1 << 62`` or ``2 ** 62`` (whole numbers: ``2.0 ** 62`` bounds a float sum against int64 overflow)."""
    return isinstance(node, ast.BinOp) and isinstance(node.left, ast.Constant) and \
        isinstance(node.right, ast.Constant) and type(node.left.value) is int and \
        (node.left.value, type(node.op), node.right.value) in ((1, ast.LShift, 62), (2, ast.Pow, 62))


def count_checks_by_hand(source: str) -> list[str]:
    """Where ``source`` checks a count against ``1 << 62`` itself (a comparison or a call spelling it), instead of
    ``bounded.is_count``; a module constant that names the number is not a check."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
        elif isinstance(node, ast.Call):
            parts = [*node.args, *(k.value for k in node.keywords)]
        else:
            continue
        out += [f"line {node.lineno}" for part in parts if _is_count_limit(part)]
    return sorted(out)


def test_a_count_is_checked_by_bounded_is_count_alone():
    """``0 <= v < 1 << 62`` is written once, in ``ondisk/bounded.py`` (``is_count``, ``COUNT_LIMIT``); elsewhere the
    number stands only as a named limit of something else (an interval, a dedup key, a step)."""
    bounded = PACKAGE / "ondisk" / "bounded.py"
    offenders = {str(p.relative_to(REPO)): found for p in sorted(PACKAGE.rglob("*.py"))
                 if p != bounded and (found := count_checks_by_hand(p.read_text(encoding="utf-8")))}
    assert offenders == {}
    from automodel_ckpt.ondisk.bounded import COUNT_LIMIT, is_count

    assert COUNT_LIMIT == 1 << 62 and is_count(0) and is_count(COUNT_LIMIT - 1)
    assert not any(is_count(v) for v in (COUNT_LIMIT, -1, True, 1.0, "1", None))
    assert count_checks_by_hand("ok = type(v) is int and 0 <= v < 1 << 62\n_ints(xs, 0, 2**62, 'n')\n") == [
        "line 1", "line 2"]
    assert count_checks_by_hand("LIMIT = 1 << 62\nok = 0 <= v < LIMIT\n") == []


# --- import sources are plug-ins: one module each and one register line, asked by the registry (issue #93) ---------

INTEROP = PACKAGE / "interop"
IMPORT_VERB = PACKAGE / "cli" / "import_run.py"


def source_modules() -> set[str]:
    """The modules of ``interop/`` that define an import source (an ``ImportSource``, or a subclass of it)."""
    return {p.stem for p in INTEROP.glob("*.py")
            if re.search(r"^(class \w+\(ImportSource\)|\w+ = ImportSource\()", p.read_text(encoding="utf-8"), re.M)}


def source_kind_tests(source: str, modules: set[str]) -> list[str]:
    """Where ``source`` chooses among import sources itself: an ``if``/``elif``, a ``while`` or a conditional
    expression whose test asks whether a path is some source's (``X.detect(...)``, or a predicate ``is_*`` of one of
    the source ``modules``: ``hf_trainer.is_hf_trainer(src)``)."""
    def asks(test: ast.AST) -> bool:
        return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and
                   (n.func.attr == "detect" or (n.func.attr.startswith("is_") and isinstance(n.func.value, ast.Name)
                                                and n.func.value.id in modules)) for n in ast.walk(test))

    return [f"line {node.lineno}: a test of a source's kind" for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.If, ast.IfExp, ast.While)) and asks(node.test)]


def test_import_picks_its_source_from_the_registry_alone():
    """``import SRC`` asks ``interop.registry`` (each source ``detect``s its own checkpoints, asked in registration
    order by ``identify``): no module of ``interop/`` nor the verb tests a path's kind in an ``if`` chain, only the
    registry calls ``detect``, and outside the sources' own modules only the registry's register lines name one."""
    from automodel_ckpt.interop.registry import source_names

    assert len(source_names()) >= 3
    sources = source_modules()
    assert {"hf_trainer", "lightning"} <= sources
    files = sorted(INTEROP.glob("*.py")) + [IMPORT_VERB]
    chains = {str(p.relative_to(REPO)): f for p in files
              if (f := source_kind_tests(p.read_text(encoding="utf-8"), sources))}
    assert chains == {}
    callers = sorted(str(p.relative_to(REPO)) for p in files if ".detect(" in p.read_text(encoding="utf-8"))
    assert callers == ["automodel_ckpt/interop/registry.py"]
    for path in (INTEROP / "__init__.py", INTEROP / "registry.py", IMPORT_VERB):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        registered = {id(n) for call in ast.walk(tree) if isinstance(call, ast.Call) and
                      getattr(call.func, "id", None) == "register_source" for n in ast.walk(call)}
        named = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                 and n.value.id in sources and id(n) not in registered]
        assert named == [], f"{path.relative_to(REPO)} names a source at lines {named}"


def test_the_source_rule_sees_an_if_chain():
    chain = ("def read_source(src):\n    if hf_trainer.is_hf_trainer(src):\n        return 1\n"
             "    elif FILE.detect(src):\n        return 2\n    return 3 if lightning.is_lightning_folder(src) else 4\n")
    modules = {"hf_trainer", "lightning"}
    assert source_kind_tests(chain, modules) == ["line 2: a test of a source's kind",
                                                 "line 4: a test of a source's kind",
                                                 "line 6: a test of a source's kind"]
    asked = "def identify(p):\n    if not p.is_dir():\n        return None\n" \
            "    return next((s for s in SOURCES if s.detect(p)), None)\n"
    assert source_kind_tests(asked, modules) == []  # a path's own predicates, and the registry's one question


# --- torch's private DCP names: one shim hands them on, with why each is needed (issue #93) -------------------------

DCP = "torch.distributed.checkpoint"
DCP_SHIM = PACKAGE / "distributed" / "dcp_private.py"
DCP_SHIM_TEST = REPO / "tests" / "unit" / "distributed" / "test_dcp_private.py"


def private_dcp_uses(source: str) -> list[str]:
    """Where ``source`` reaches a private name of torch's DCP: an import from a private module
    (``torch.distributed.checkpoint._hf_utils``) or of a private name (``from ...filesystem import _StorageInfo``,
    ``from torch.distributed.checkpoint import _version``), ``import`` of a private module, or a private attribute
    of a DCP module (``torch.distributed.checkpoint.filesystem._StorageInfo``, ``dcp._x`` where ``dcp`` is bound to
    one)."""
    def private(dotted: str) -> bool:
        return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))

    out, bound = [], set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == DCP or a.name.startswith(DCP + "."):
                    out += [f"line {node.lineno}: import {a.name}"] if private(a.name) else []
                    bound.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.module and (node.module == DCP or
                                                                   node.module.startswith(DCP + ".")):
            out += [f"line {node.lineno}: from {node.module} import {a.name}" for a in node.names
                    if private(f"{node.module}.{a.name}")]
            bound |= {a.asname or a.name for a in node.names}  # a DCP module among them: its attributes count too
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = ast.unparse(node.value)
            if owner in bound or owner == DCP or owner.startswith(DCP + "."):
                out.append(f"line {node.lineno}: {owner}.{node.attr}")
    return sorted(set(out))


def test_private_dcp_names_are_imported_by_one_shim():
    """torch's private DCP names are reached in two files only: ``distributed/dcp_private.py`` (which says why each
    is needed and against which torch it was checked), below every room that uses it, and its test; every other
    module of the package imports them from the shim."""
    users = sorted(str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
                   if private_dcp_uses(p.read_text(encoding="utf-8")))
    assert users == [str(DCP_SHIM.relative_to(REPO))]
    assert private_dcp_uses(DCP_SHIM_TEST.read_text(encoding="utf-8"))  # the other file: the shim's test
    assert len(users) + 1 <= 2
    doc = ast.get_docstring(ast.parse(DCP_SHIM.read_text(encoding="utf-8"))) or ""
    assert re.search(r"torch \d+\.\d+", doc)
    shim = importlib.import_module("automodel_ckpt.distributed.dcp_private")
    assert [n for n in shim.__all__ if f"``{n}" not in doc] == [], "say why each name is needed"


def test_the_private_dcp_rule_sees_each_way_in():
    source = ("from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo\n"
              "from torch.distributed.checkpoint._hf_utils import FORMAT_KEY\n"
              "import torch.distributed.checkpoint as dcp\n"
              "from torch.distributed.checkpoint import default_planner\n"
              "def f():\n    from torch.distributed.checkpoint import _version\n"
              "    default_planner._check_box_overlap = dcp._x\n"
              "    return torch.distributed.checkpoint.filesystem._StoragePrefix\n")
    assert private_dcp_uses(source) == [
        "line 1: from torch.distributed.checkpoint.filesystem import _StorageInfo",
        "line 2: from torch.distributed.checkpoint._hf_utils import FORMAT_KEY",
        "line 6: from torch.distributed.checkpoint import _version", "line 7: dcp._x",
        "line 7: default_planner._check_box_overlap", "line 8: torch.distributed.checkpoint.filesystem._StoragePrefix"]
    assert private_dcp_uses("import torch.distributed.checkpoint as dcp\nfrom torch.distributed.checkpoint.metadata "
                            "import Metadata\ndcp.save(x)\nself._x = Metadata.__name__\n") == []
