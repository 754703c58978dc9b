"""The import graph of ``lcsb_lightning``, read with ``ast`` (imports inside functions included): no module
imports itself through others, none imports another module's ``_private`` names, and every module that is not
Lightning glue (computed from the package: :func:`_lightning_glue`) imports without Lightning's trainer."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from graphlib import CycleError, TopologicalSorter
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1] / "lcsb_lightning"
PACKAGE = ROOT.name


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(module: str) -> Iterator[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` for each ``lcsb_lightning`` import of ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    yield f"{base}.{alias.name}", None, node.lineno
                else:
                    yield base, alias.name, node.lineno


def _graph() -> dict[str, set[str]]:
    return {m: {target for target, _, _ in _imports(m) if target in MODULES and target != m} for m in MODULES}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its first module repeated at the end), or None."""
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as error:
        return error.args[1]
    return None


def test_the_graph_sees_imports_inside_functions() -> None:
    assert "lcsb_lightning.bench.runner" in _graph()["lcsb_lightning.recipes.cli"]  # imported in a function


def test_no_import_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert _cycle(_graph()) is None


def _private_imports() -> list[str]:
    return [f"{MODULES[m].relative_to(ROOT.parent)}:{line}: {name} from {target}"
            for m in MODULES for target, name, line in _imports(m)
            if target in MODULES and target != m and name and name.startswith("_") and not name.startswith("__")]


def test_no_private_names_imported_from_other_modules() -> None:
    assert _private_imports() == []


_LIGHTNING = ("lightning", "pytorch_lightning")
#: Lightning's rank-zero messages: :mod:`lcsb_lightning.rank_zero` gives them without the trainer.
_RANK_ZERO = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


def _module_level_imports(module: str) -> dict[str, str]:
    """Each name bound by an import run when ``module`` is imported (its body's, not a function's, an ``if``'s or a
    ``TYPE_CHECKING`` block's), mapped to the module it comes from."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    bound: dict[str, str] = {}
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            bound.update({alias.asname or alias.name.split(".")[0]: alias.name for alias in node.names})
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *([base] if base else [])])
            bound.update({alias.asname or alias.name: f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                          for alias in node.names})
    return bound


def _is_lightning(source: str) -> bool:
    return source.split(".")[0] in _LIGHTNING


def _defines_lightning_class(module: str, glue: set[str]) -> bool:
    """Whether ``module`` defines a class deriving from Lightning's (``Callback``, ``Precision``, ``LightningModule``,
    ``Checkpoint``, ...) or from a class of a glue module."""
    bound = _module_level_imports(module)
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        for base in node.bases if isinstance(node, ast.ClassDef) else ():
            while isinstance(base, ast.Attribute):
                base = base.value
            source = bound.get(base.id, "") if isinstance(base, ast.Name) else ""
            if _is_lightning(source) or source in glue:
                return True
    return False


def _lightning_glue() -> tuple[set[str], set[str]]:
    """``(glue, direct glue)``: the modules built on Lightning, and those of them that are so by their own source.

    A module is Lightning glue by its own source when it defines a Lightning class (a callback, a plugin, a
    LightningModule, a checkpoint IO: a class deriving from Lightning's or another glue module's), or when its body
    imports Lightning for more than the rank-zero messages (``recipes/train.py`` builds a ``Trainer``). A module
    whose body imports a glue module is glue as well (the benchmark's runner, the recipes' config builder).
    """
    direct: set[str] = set()
    while True:
        found = {m for m in MODULES if _defines_lightning_class(m, direct) or any(
            _is_lightning(source) and not source.startswith(_RANK_ZERO) for source in _module_level_imports(m).values())}
        if found == direct:
            break
        direct = found
    glue = set(direct)
    while grown := {m for m in MODULES if m not in glue and glue & set(_module_level_imports(m).values())}:
        glue |= grown
    return glue, direct


def _exported() -> dict[str, str]:
    """Each public name of the package and of ``lcsb_lightning.mebp`` (its ``__init__``'s imports and its ``_LAZY``
    table), mapped to the module it comes from."""
    out = {}
    for package in (PACKAGE, f"{PACKAGE}.mebp"):
        where = _module_level_imports(package)
        for node in ast.parse(MODULES[package].read_text()).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_LAZY":
                where.update(ast.literal_eval(node.value))
        out.update({f"{package}.{name}": module for name, module in where.items()
                    if not name.startswith("_") and module in MODULES})
    return out


def test_the_glue_rule_sees_lightning_classes_trainers_and_their_importers() -> None:
    glue, direct = _lightning_glue()
    assert {"lcsb_lightning.callback", "lcsb_lightning.mebp.plugin", "lcsb_lightning.recipes.module",
            "lcsb_lightning.recipes.train"} <= direct
    assert "lcsb_lightning.bench.runner" in glue - direct
    assert not {"lcsb_lightning.rank_zero", "lcsb_lightning.recompute", "lcsb_lightning.mebp.loss"} & glue


def test_every_public_name_lives_in_the_plain_torch_core_or_in_glue_of_its_own() -> None:
    """A plain-torch module cannot leave the core by importing glue: each exported name lives in a module outside the
    glue, or in one that is glue by its own source (``LCSBCallback``, ``QuantizedMeBP``, ``load_smollm2``)."""
    glue, direct = _lightning_glue()
    exported = _exported()
    assert exported["lcsb_lightning.recompute_lower_blocks"] == "lcsb_lightning.recompute"
    assert {name: module for name, module in exported.items() if module in glue - direct} == {}


def test_the_plain_torch_core_does_not_import_lightning_pytorch() -> None:
    """A module that is not Lightning glue (:func:`_lightning_glue`) imports without Lightning's trainer
    (``lightning.pytorch``, about 2.8 s and 40 MB): the policies and the controller, ``recompute_lower_blocks``,
    ``apply_mebp``, ``chunked_lm_loss`` serve a hand-written training loop. Each is imported in turn in a fresh
    interpreter (this one has imported Lightning already); the first whose import loads the trainer is named."""
    glue, _ = _lightning_glue()
    core = sorted(set(MODULES) - glue)
    assert len(core) > len(glue)
    code = ("import importlib, sys\n"
            f"for name in {core!r}:\n"
            "    importlib.import_module(name)\n"
            "    if 'lightning.pytorch' in sys.modules:\n"
            "        print(name); break\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "", f"importing {out.stdout.strip()} loads lightning.pytorch"


def test_library_code_does_not_use_unittest() -> None:
    """``unittest.mock`` is a test tool: library code restores what it changes itself, explicitly."""
    uses = [f"{MODULES[m].relative_to(ROOT.parent)}:{line}" for m in MODULES for target, _, line in _imports(m)
            if target.split(".")[0] == "unittest"]
    assert uses == []
