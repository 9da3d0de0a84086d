"""The layers of DESIGN.md, held: every `import` and `from ... import` of a Kiln module, at module top and inside
functions alike (a function-local import only postpones a circle), read with ast, nothing imported.

    tests      test support, fixtures, the tests                      may import every layer below
    scripts    the CLIs and the entry layer (scripts/kiln/)           imports data, recipes, common
    data       dataset and demo-base builders                         imports recipes (registry), common
    recipes    one folder per family + the registry                   imports common
    common     the library every recipe uses                          imports nothing above it

No cycle among modules, nor among the layers; no family's module (`recipes.<family>`) named outside recipes/ but by
the registry, except the family-specific tools listed in FAMILY_TOOLS (a list that only shrinks)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("common", "recipes", "data", "scripts")
# Each layer and the layers it must not import (tests, the top, is not product code: nothing imports it).
FORBIDDEN = {
    "common": ("recipes", "data", "scripts", "tests"),
    "recipes": ("data", "scripts", "tests"),
    "data": ("scripts", "tests"),
    "scripts": ("tests",),
}
FAMILIES = ("dit", "t2i", "video", "vlm", "llm")
# Family-specific tools outside recipes/ that import their family's modules by name today (a DiT's export/eval/sample
# CLIs, a benchmark section per family, the latent cache's decoders). Known and left for now: each should reach its
# family through the registry (a spec field) and leave this list. No file may join it.
FAMILY_TOOLS = {
    "scripts.benchmarks.checkpoint",
    "scripts.benchmarks.dit",
    "scripts.benchmarks.export",
    "scripts.benchmarks.loading",
    "scripts.benchmarks.lora",
    "scripts.benchmarks.moe",
    "scripts.benchmarks.overhead",
    "scripts.benchmarks.pipeline",
    "scripts.benchmarks.serving",
    "scripts.benchmarks.t2i",
    "scripts.eval_dit",
    "scripts.eval_t2i",
    "scripts.export_dit",
    "scripts.gpu_check",
    "scripts.sample_dit",
}
# Cycles known and left for now, each as the sorted modules of one strongly connected component.
# None today; recipes/vlm's (config -> pretrained -> model <-> parallelize) is gone and must stay gone.
ALLOWED: set[tuple[str, ...]] = set()


def kiln_modules() -> dict[str, Path]:
    """Dotted name -> file, for every .py file under PACKAGES (data/cache, the datasets, left out)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[:2] == ("data", "cache"):
                continue
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def imported_names(name: str, path: Path) -> set[str]:
    """Every dotted name `path` imports anywhere in it (`from a.b import c` gives a.b and a.b.c)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Kiln module -> the Kiln modules it imports (a name resolves to its longest Kiln module prefix)."""
    modules = kiln_modules()
    graph = {}
    for name, path in modules.items():
        edges = set()
        for target in imported_names(name, path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
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
                    found.append(tuple(sorted(component)))
    return found


def test_cycles_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [("a", "b", "c")]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_function_level_and_relative_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os\nfrom . import sibling\n\ndef f():\n    from recipes.vlm.model import build_model\n")
    assert imported_names("recipes.vlm.m", path) == {
        "os",
        "recipes.vlm",
        "recipes.vlm.sibling",
        "recipes.vlm.model",
        "recipes.vlm.model.build_model",
    }


def test_no_import_cycles_among_kiln_modules():
    graph = import_graph()
    assert "recipes.vlm.config" in graph and "common.trainer" in graph
    found = set(cycles(graph))
    new = found - ALLOWED
    described = [" -> ".join(f"{m} ({', '.join(sorted(graph[m] & set(c)))})" for m in c) for c in sorted(new)]
    assert not new, "import cycles (each module with the cycle's modules it imports): " + "; ".join(described)
    assert not [c for c in found if any(m.startswith("recipes.vlm") for m in c)]
    assert not ALLOWED - found, f"cycles in ALLOWED that are gone (remove them): {sorted(ALLOWED - found)}"


def test_product_code_never_imports_the_tests():
    """common, recipes, data and scripts run where tests/ is not installed (a wheel, a GPU node's checkout may lack
    it): a demo base they need lives in data/tiny_bases.py, the way they start a run in scripts/kiln/processes.py."""
    offenders = sorted(
        f"{name} imports {target}"
        for name, path in kiln_modules().items()
        for target in imported_names(name, path)
        if target == "tests" or target.startswith("tests.")
    )
    assert not offenders, "; ".join(offenders)


def test_a_recipe_never_imports_another_recipe():
    """A recipe is one family: what two families share lives in common/ (the DiT and text-to-image share
    common/diffusion); only the registry, which lists every family, imports them all."""
    offenders = sorted(
        f"{name} imports {target}"
        for name, path in kiln_modules().items()
        if name.startswith("recipes.") and name != "recipes.registry"
        for target in imported_names(name, path)
        if target.startswith("recipes.") and target != "recipes.registry" and target.split(".")[1] != name.split(".")[1]
    )
    assert not offenders, "; ".join(offenders)


def test_training_code_never_imports_a_dataset_builder():
    """recipes and common run a dataset's builder as a subprocess (data.build) and read what it wrote; the format both
    sides need (a meta.json source, its skip summary, ...) lives below them, in common/data or the recipe."""
    offenders = sorted(
        f"{name} imports {target}"
        for name, path in kiln_modules().items()
        if name.split(".")[0] in ("recipes", "common")
        for target in imported_names(name, path)
        if target == "data" or target.startswith("data.")
    )
    assert not offenders, "; ".join(offenders)


def test_comments_cite_no_document_the_repository_lacks():
    """A comment citing a document (an upper-case name, .md) that a checkout lacks: the code states the fact instead."""
    import re

    files = [*kiln_modules().values(), *sorted((REPO / "tests").rglob("*.py"))]
    docs = [*REPO.glob("*.md"), *(p for d in (*PACKAGES, "tests") for p in (REPO / d).rglob("*.md"))]
    present = {p.name for p in docs}
    cited = sorted(
        f"{path.relative_to(REPO)}: {name}"
        for path in files
        for name in set(re.findall(r"\b([A-Z][A-Z_]*\.md)\b", path.read_text()))
        if name not in present
    )
    assert not cited, "; ".join(cited)


def layer_imports(root: Path = REPO) -> set[tuple[str, str, str]]:
    """(layer, module, imported layer) for every import of another top-level layer, tests included."""
    layers = (*PACKAGES, "tests")
    found = set()
    for layer in layers:
        for path in sorted((root / layer).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[:2] == ("data", "cache"):
                continue
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            for target in imported_names(name, path):
                top = target.split(".")[0]
                if top in layers and top != layer:
                    found.add((layer, name, top))
    return found


def test_each_layer_imports_only_the_layers_below_it():
    """common is a library: it imports nothing above it (the registry is handed to it, profiler traces are merged by
    the launcher after the run); recipes import no builder, CLI or test; data no CLI or test; nothing the tests."""
    offenders = sorted(
        f"{name} imports {top}" for layer, name, top in layer_imports() if top in FORBIDDEN.get(layer, ())
    )
    assert not offenders, "; ".join(offenders)


def test_no_cycle_between_the_layers():
    graph: dict[str, set[str]] = {layer: set() for layer in (*PACKAGES, "tests")}
    for layer, _, top in layer_imports():
        graph[layer].add(top)
    assert cycles(graph) == [], f"layers importing each other: {cycles(graph)}"


def family_imports() -> dict[str, set[str]]:
    """Module outside recipes/ (or the registry) -> the family modules (`recipes.<family>...`) it imports."""
    found: dict[str, set[str]] = {}
    for name, path in kiln_modules().items():
        if name.startswith("recipes.") and name != "recipes.registry":
            continue
        named = {t for t in imported_names(name, path) if t.split(".")[:2][-1] in FAMILIES and t.startswith("recipes.")}
        if named and name != "recipes.registry":
            found[name] = named
    return found


def test_only_recipes_and_the_registry_name_a_family():
    """The launcher, serving, the planner and common/ ask the registry (recipes/registry.py) what a family provides;
    they never import `recipes.<family>` themselves. FAMILY_TOOLS: the known per-family tools, a list that shrinks."""
    found = family_imports()
    new = sorted(f"{name} imports {', '.join(sorted(found[name]))}" for name in set(found) - FAMILY_TOOLS)
    assert not new, "; ".join(new)
    assert not FAMILY_TOOLS - set(found), (
        f"FAMILY_TOOLS that no longer name a family (remove them): {FAMILY_TOOLS - set(found)}"
    )
    assert not [n for n in found if n.startswith(("common.", "scripts.kiln."))]


def test_the_layer_checks_catch_an_upward_import(tmp_path):
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "x.py").write_text("def f():\n    from scripts.kiln.launch import main\n")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "y.py").write_text("import common.x\n")
    found = layer_imports(tmp_path)
    assert ("common", "common.x", "scripts") in found and ("scripts", "scripts.y", "common") in found
    graph = {"common": {"scripts"}, "scripts": {"common"}}
    assert cycles(graph) == [("common", "scripts")]
