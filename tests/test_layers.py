"""The import structure: packages in layers, every import pointing down, no cycle between modules.

    cli      service.__main__, service.quickstart, service.configdoc, service.demo
    loadtest        (the load test and the soak: clients of the service, with the LM side's client helpers)
    procs    lm     (processes: supervisor, engine / API processes, single process | the LM side)
    api             (HTTP, encode orchestration, the Runtime)
    engine          (batcher, step loop, runner, writer, tower, the engine host and its client)
    settings        service.config (Settings and the options derived from it), service.flags, service.metrics
    media    store  (each with its own parameter and option types, which Settings builds)
    base     service.errors, service.presets, service.priority, service.tracing; qve_kernels

A module may import its own package, any package of a lower layer, and nothing else: not a package of a
higher layer, nor another package of its own layer. Function-local imports count: a lazy import hides
a dependency from a reader, not from this test. Read from the source with `ast` (nothing is imported).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[set[str]] = [
    {"base", "qve_kernels"},
    {"service.media", "service.store"},
    {"settings"},
    {"service.engine"},
    {"service.api"},
    {"service.procs", "service.lm"},
    {"service.loadtest"},
    {"cli"},
]
BASE = {"service.errors", "service.presets", "service.priority", "service.sizes", "service.tracing"}
SETTINGS = {"service.config", "service.flags", "service.metrics"}
CLI = {"service.__main__", "service.quickstart", "service.configdoc", "service.demo"}


def _modules() -> dict[str, Path]:
    """service's modules, and the kernels package's (kernels/qve_kernels, imported as qve_kernels)."""
    found = {}
    paths = [(ROOT, p) for p in (ROOT / "service").rglob("*.py")]
    paths += [(ROOT / "kernels", p) for p in (ROOT / "kernels" / "qve_kernels").rglob("*.py")]
    for top, path in paths:
        parts = list(path.relative_to(top).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project's modules that `name` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` names a module; `from mod import name` the module itself.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import a.b.c` of a module: its deepest existing prefix
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _group(module: str) -> str:
    if module in BASE:
        return "base"
    if module in SETTINGS:
        return "settings"
    if module in CLI:
        return "cli"
    if module.split(".")[0] == "qve_kernels":
        return "qve_kernels"
    group = ".".join(module.split(".")[:2])
    assert any(group in layer for layer in LAYERS), f"{module}: a module of service/ in no layer (add it to LAYERS)"
    return group


def _layer(group: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if group in layer)


def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def violations(edges: dict[str, set[str]]) -> list[str]:
    """Each import that points up a layer or across to another package of the same layer."""
    bad = []
    for src, targets in edges.items():
        if src == "service":
            continue
        g = _group(src)
        for dst in sorted(targets):
            if dst == "service":
                continue
            h = _group(dst)
            if h != g and _layer(h) >= _layer(g):
                bad.append(f"{src} imports {dst} ({h} is {'above' if _layer(h) > _layer(g) else 'beside'} {g})")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_import_points_down_a_layer_or_stays_in_its_package():
    assert violations(graph()) == []


def test_no_module_imports_itself_back_through_others():
    assert cycles(graph()) == []


# The store's backends and their parts: only service/store/ itself names them (open_store picks one).
STORE_BACKEND = {"service.store.directory", "service.store.mooncake", "service.store.pool", "service.store.files", "service.store.index",
                 "service.store.lookups", "service.store.values", "service.store.calls"}


def backend_imports(edges: dict[str, set[str]]) -> list[str]:
    """Each import of a store backend module from outside service/store/."""
    return [f"{src} imports {dst}" for src, targets in sorted(edges.items()) if not src.startswith("service.store")
            for dst in sorted(targets & STORE_BACKEND)]


def test_nothing_outside_the_store_names_a_backend():
    assert backend_imports(graph()) == []
    edges = graph()
    edges["service.engine.host"] = edges["service.engine.host"] | {"service.store.directory"}
    assert backend_imports(edges) == ["service.engine.host imports service.store.directory"]


def test_the_checks_fail_on_an_upward_import_and_on_a_cycle():
    edges = graph()
    before = set(violations(edges))
    edges["service.media.images"] = edges["service.media.images"] | {"service.api.encode"}  # media -> api: up
    assert set(violations(edges)) - before == {
        "service.media.images imports service.api.encode (service.api is above service.media)"}
    assert any("service.media.images" in c and "service.api.encode" in c for c in cycles(edges))
    edges = graph()
    edges["service.store.format"] = edges["service.store.format"] | {"service.media.preprocess"}  # beside
    assert set(violations(edges)) - before == {
        "service.store.format imports service.media.preprocess (service.media is beside service.store)"}
