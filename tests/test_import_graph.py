"""The import graph of ``lcsb_lightning``, read with ``ast`` (imports inside functions included): no module
imports itself through others, and none imports another module's ``_private`` names."""

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


#: The plain-torch core: what a hand-written training loop imports to use selective backprop or the frozen prefix.
PLAIN_TORCH_CORE = ("lcsb_lightning.policies", "lcsb_lightning.controller", "lcsb_lightning.prefix_cache",
                    "lcsb_lightning.blocks")


def test_the_plain_torch_core_does_not_import_lightning_pytorch() -> None:
    """``LCSBController`` is the way to use selective backprop in a plain loop: importing it must not load Lightning's
    trainer (about 2.8 s). In a fresh interpreter, since this one has imported Lightning already."""
    code = (f"import sys, {', '.join(PLAIN_TORCH_CORE)}\n"
            "print(sorted(name for name in sys.modules if name.split('.')[:2] == ['lightning', 'pytorch'])[:5])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stdout


def test_library_code_does_not_use_unittest() -> None:
    """``unittest.mock`` is a test tool: library code restores what it changes itself, explicitly."""
    uses = [f"{MODULES[m].relative_to(ROOT.parent)}:{line}" for m in MODULES for target, _, line in _imports(m)
            if target.split(".")[0] == "unittest"]
    assert uses == []
