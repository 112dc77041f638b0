"""Imports run one way: distributed -> api, families -> validation, selection, launch -> config,
launch -> kernel_cache -> cache -> kernels; no module imports one above it, and nothing in numflash forms an import cycle.
A family's module (numflash/families/) stands above the generic layers it registers into."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "numflash"

#: Each module's layer: a module may import only modules of a lower layer (kernels/ among
#: themselves, as long as there is no cycle).
LAYERS = {
    "distributed": 6,
    "jax": 6,
    "api": 5,
    "families": 5,
    "cli": 6,
    "validation": 4,
    "selection": 4,
    "launch": 4,
    "plans": 4,
    "signature": 4,
    "kernel_cache": 3.5,  # compiled kernels on disk: under launch, over cache's directory
    "cache": 3,
    "block_masks": 3,
    "config": 2,
    "device": 1,
    "arrays": 1,
    "reference": 2,
    "timing": 2,
    "kernels": 0,
}


def _module_imports(path):
    """The numflash modules ``path`` imports (top-level names: 'config', 'kernels', ...)."""
    tree = ast.parse(path.read_text())
    inside_kernels = path.parent.name == "kernels"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] == "numflash" and len(parts) > 1:
                    found.add(parts[1])
                continue
            base = "kernels" if inside_kernels and node.level == 1 else None
            if node.module:
                found.add(base or node.module.split(".")[0])
            else:
                found.update(base or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "numflash" and len(parts) > 1:
                    found.add(parts[1])
    return found


def _graph():
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        package = path.parent.name
        name = package if package in ("kernels", "families") else path.stem
        if name in ("__init__", "__main__"):
            continue
        graph.setdefault(name, set()).update(_module_imports(path) - {name})
    return graph


def test_every_module_has_a_layer():
    assert set(_graph()) <= set(LAYERS)


def test_imports_run_one_way():
    for module, imported in _graph().items():
        for other in imported & set(LAYERS):
            assert LAYERS[other] < LAYERS[module], f"numflash.{module} imports numflash.{other}"


def test_kernel_modules_import_no_cycle():
    graph = {}
    for path in (PACKAGE / "kernels").glob("*.py"):
        tree = ast.parse(path.read_text())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps.update([node.module] if node.module else [a.name for a in node.names])
        graph[path.stem] = deps
    done, active = set(), []

    def visit(name):
        assert name not in active, "import cycle: " + " -> ".join(active + [name])
        if name in done or name not in graph:
            return
        active.append(name)
        for dep in graph[name]:
            visit(dep)
        active.pop()
        done.add(name)

    for name in graph:
        visit(name)
