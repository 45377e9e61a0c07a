"""Model-free: the backend's layers point one way, read from the source (type-only imports count too).

- cross-prefix reuse (``backend/reuse/``) imports nothing above it: not the engine, the request
  lifecycle or anything else of the runtime, the stats, the cluster or the server. The lifecycle runs
  the reuse step and hands it a ``Forward``; the step never calls back up;
- the stats read the request counters from their own leaf module, never the lifecycle or a cluster
  worker, and the counters import nothing of the backend;
- every backend module imports only from its own package or a lower layer (``LAYERS``), and no product
  module imports itself through others.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BACKEND = Path(__file__).resolve().parents[1] / "backend"
PACKAGE = "kvbaton.backend"


def imports(path: Path) -> set[str]:
    """The absolute names of the modules ``path`` imports, at any depth of its code."""
    parts = path.relative_to(BACKEND).with_suffix("").parts
    package = [*PACKAGE.split("."), *parts[:-1]]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)  # ``from . import x``: a module
    return names


def above(names: set[str], layers: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == f"{PACKAGE}.{layer}" or n.startswith(f"{PACKAGE}.{layer}.")
                                          for layer in layers))


@pytest.mark.parametrize("module", sorted(p.name for p in (BACKEND / "reuse").glob("*.py")))
def test_reuse_imports_nothing_above_it(module):
    found = imports(BACKEND / "reuse" / module)
    assert above(found, ("engine", "runtime", "stats", "cluster", "server", "sglang_plugin")) == []


def test_the_stats_read_counters_not_the_lifecycle_or_a_worker():
    assert above(imports(BACKEND / "stats.py"), ("runtime.lifecycle", "cluster.worker", "engine")) == []
    assert "kvbaton.backend.runtime.counters" in imports(BACKEND / "stats.py")
    assert [n for n in imports(BACKEND / "runtime" / "counters.py") if n.startswith(PACKAGE)] == []


def test_the_lifecycle_calls_the_reuse_step_not_the_engine():
    found = imports(BACKEND / "runtime" / "lifecycle.py")
    assert "kvbaton.backend.reuse.place" in found
    assert above(found, ("engine", "stats", "reuse.compose", "cluster", "server")) == []


# The backend's layers, lowest first: a module imports only from its own package or a lower layer
# (type-only imports included). A newcomer finds a concept by folder; nothing reaches up.
LAYERS = (
    ("dirs", "tenants", "handles", "events"),  # leaves: they import nothing of the backend
    ("cache",),  # block pool, radix cache, tiers, spill, prefetch, persistence (journal, saved blocks), the KV manager
    ("models",),  # the model families' registry: what each family's layer is (read by compute and reuse)
    ("compute",),  # loading a model and running it: the runner seam, cpu/, cuda/
    ("inputs",),  # text, token ids and chat messages to validated token ids
    ("reuse",),  # cross-prefix reuse: span index, placement, correction, composition, audit
    ("runtime",),  # one request from admission to its result; the scheduler
    ("config", "stats"),
    ("hosting",),
    ("engine",),
    ("__init__",),  # the package's lazy names (Engine, load_model)
    ("cluster",),
    ("server",),
    ("sglang_plugin",),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _layer(module: str) -> str | None:
    """The layer of a ``kvbaton.backend...`` module (its sub-package, or its own name at the top)."""
    parts = module.split(".")
    if parts[:2] != ["kvbaton", "backend"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


@pytest.mark.parametrize("path", sorted(BACKEND.rglob("*.py")), ids=lambda p: str(p.relative_to(BACKEND)))
def test_every_backend_import_points_down_the_layers(path):
    own = _layer(".".join([PACKAGE, *path.relative_to(BACKEND).with_suffix("").parts]).removesuffix(".__init__"))
    assert own in RANK, f"{path} is in no layer of LAYERS: add its package there"
    upward = sorted(n for n in imports(path) if (layer := _layer(n)) not in (None, own)
                    and layer in RANK and RANK[layer] >= RANK[own])
    assert upward == [], f"{path.relative_to(BACKEND)} imports from its own layer or above: {upward}"


def _product_imports() -> dict[str, set[str]]:
    """Every product module (kvbaton, its adapters, backend, bench, examples) and the product modules
    it imports at any depth, type-only imports included."""
    root = BACKEND.parent
    folders = {"sdk": "kvbaton", "adapters": "kvbaton.adapters", "backend": "kvbaton.backend",
               "bench": "kvbaton.bench", "examples": "kvbaton.examples"}
    modules: dict[str, Path] = {}
    for folder, package in folders.items():
        for path in (root / folder).rglob("*.py"):
            name = ".".join([package, *path.relative_to(root / folder).with_suffix("").parts])
            modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])]) \
                    if node.level else (node.module or "")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def test_no_product_module_imports_itself_through_others():
    """No import circle anywhere in the product, type-only imports included (Tarjan's strongly
    connected components, iteratively)."""
    graph = _product_imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    assert circles == []
