"""The package's layering, read from the source (ast; nothing is imported): no import cycle between
nanoflow's modules, function-level imports included; every package and top-level module sits in the layer
table below, and imports only what its layer may; the pure layer imports no torch. docs/design.md draws the map.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "nanoflow"   # this file is in tests/unit/ of the checkout


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> set[str]:
    """Every module `name` imports anywhere in its body (top level, functions, try blocks): nanoflow modules
    resolved to the module file they execute, others by their top-level package (torch, numpy, …)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: from . import x, from ..io import y
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:   # `from nanoflow.io import hf` imports the module nanoflow.io.hf
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in MODULES else base)
    return {m if m.split(".")[0] == "nanoflow" else m.split(".")[0] for m in found}


GRAPH = {name: {m for m in imports(name) if m in MODULES and m != name} for name in MODULES}


def _above_io(imported: str) -> bool:
    """What nanoflow.io may not import: any nanoflow module outside io itself, but the error root and the version."""
    return imported.startswith("nanoflow") and imported not in ("nanoflow.errors", "nanoflow.version") \
        and not (imported == "nanoflow.io" or imported.startswith("nanoflow.io."))


def violations() -> dict[str, set[tuple[str, str]]]:
    """Each rule's offending (module, imported) pairs."""
    found: dict[str, set[tuple[str, str]]] = {"io": set(), "torch": set(), "model": set()}
    for name in MODULES:
        imported = imports(name)
        if name == "nanoflow.io" or name.startswith("nanoflow.io."):
            found["io"] |= {(name, m) for m in imported if _above_io(m)}
        if name in ("nanoflow.schedule", "nanoflow.lr", "nanoflow.errors", "nanoflow.version") or name == "nanoflow.config" or name.startswith("nanoflow.config."):
            found["torch"] |= {(name, m) for m in imported if m == "torch"}
        if name == "nanoflow.model":   # the decoder: torch, and of nanoflow only its loss and attention (torch
            # functions, like layers)
            found["model"] |= {(name, m) for m in imported if m.startswith("nanoflow")
                               and m not in ("nanoflow.loss", "nanoflow.attention")}
        if name in ("nanoflow.loss", "nanoflow.attention"):    # ... which themselves import nothing of nanoflow
            found["model"] |= {(name, m) for m in imported if m.startswith("nanoflow")}
    return found


def cycle_edges(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every import cycle."""
    index, low, stack, on_stack, components, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_walk_sees_the_package():
    # The walk is only as good as what it finds: the modules, and imports at every level of a body.
    assert {"nanoflow", "nanoflow.training.loop", "nanoflow.io.hf", "nanoflow.config.checks", "nanoflow.preflight"} <= set(MODULES)
    assert "nanoflow.io.checkpoint" in GRAPH["nanoflow.io.hf"]
    assert "nanoflow.training.loop" in GRAPH["nanoflow.commands.cli"]                  # a function-level import
    assert "torch" in imports("nanoflow.model")


def test_cycle_finder_finds_cycles():
    assert cycle_edges({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycle_edges({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    assert cycle_edges(GRAPH) == []


def test_io_knows_bytes_only():
    assert sorted(violations()["io"]) == []


def test_pure_modules_import_no_torch():
    assert sorted(violations()["torch"]) == []


def test_the_model_knows_nothing_of_training():
    assert sorted(violations()["model"]) == []


def unit(module: str) -> str:
    """The layer table's key of a module: its package under nanoflow, or the top-level module itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "nanoflow"


PURE = {"errors", "version", "schedule", "lr", "config"}   # no torch, no IO: the stage math and the config's rules
KERNEL = {"loss", "attention", "model", "flops", "console", "state", "step", "build", "run", "preflight", "evaluation"}
# What each unit may import of nanoflow (besides itself). Read top to bottom: a layer sees only those above it.
MAY_IMPORT = {
    "nanoflow": {"version"},                  # the package root: its public names are imported on first use
    "errors": set(), "version": set(),
    "schedule": {"errors"},
    "lr": {"errors", "schedule"},
    "config": {"errors", "lr", "schedule"},
    "io": {"errors", "version"},              # bytes only: it knows no model, no config, no run
    "data": {"errors", "config", "io", "schedule", "lr"},   # knows nothing of a run: never the loop or the checkpointer
    "loss": set(),                            # a torch function, like a layer
    "attention": set(),                       # likewise
    "model": {"loss", "attention"},           # the decoder knows nothing of training
    "flops": {"config"},
    "console": {"errors"},
    "parallel": PURE | {"io", "model", "loss", "attention"},
    "state": PURE | {"model", "parallel"},
    "step": PURE | {"model", "loss", "parallel", "state", "data"},
    "preflight": PURE | {"io", "data", "model", "flops", "parallel"},
    "run": PURE | {"io", "data", "model", "flops", "parallel", "preflight", "console"},
    "build": PURE | {"io", "data", "model", "parallel", "preflight", "state", "run"},
    "observe": PURE | {"io", "console", "flops"},          # observers show and record; they never save
    "evaluation": PURE | {"io", "data", "model", "parallel", "state", "step", "build", "run", "observe"},
    "checkpoint": PURE | {"io", "data", "model", "parallel", "console", "state", "build", "run"},
    "interop": PURE | {"io", "data", "console"},
    "training": (PURE | KERNEL | {"io", "data", "parallel", "observe", "checkpoint"}),
    "commands": None,                         # on top: may import anything, and nothing imports it
}


def test_every_package_has_a_place_in_the_layer_table():
    assert {unit(name) for name in MODULES} - set(MAY_IMPORT) == set()


def test_each_layer_imports_only_what_it_may():
    found = sorted((name, imported) for name, imported_set in GRAPH.items() for imported in imported_set
                   if unit(imported) != unit(name) and MAY_IMPORT[unit(name)] is not None
                   and unit(imported) not in MAY_IMPORT[unit(name)])
    assert found == []


def test_nothing_imports_the_commands():
    assert sorted((name, m) for name, ms in GRAPH.items() for m in ms
                  if unit(m) == "commands" and unit(name) != "commands") == []


def test_the_layer_rules_can_fail():
    # A table that allowed everything would pass any tree: one real edge, checked against a table without it.
    assert "nanoflow.checkpoint.checkpointer" in {m for m in GRAPH["nanoflow.training.loop"]}
    assert "checkpoint" not in MAY_IMPORT["observe"] and "training" not in MAY_IMPORT["data"]



DESIGN = PACKAGE.parent / "docs" / "design.md"


def documented_layers() -> dict[str, set[str] | None]:
    """docs/design.md's layer table, read back into MAY_IMPORT's shape: unit → what it may import (None: anything)."""
    text = DESIGN.read_text()
    table = text[text.index("\n## Layers\n"):]
    table = table[:table.index("\n## ", 1)]
    found: dict[str, set[str] | None] = {}
    for row in table.splitlines():
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        units = [name.strip("`").removesuffix(".py").removesuffix("/") for name in cells[0].split(", ")]
        units = ["nanoflow" if name == "__init__" else name.split("`")[0].removesuffix("/") for name in units]
        allowed: set[str] | None = set()
        for word in cells[2].split(", "):
            if word.startswith("anything"):
                allowed = None
            elif word == "+pure":
                allowed |= PURE
            elif word == "the kernel":
                allowed |= KERNEL
            elif word != "nothing":
                allowed.add(word)
        for name in units:
            found[name] = allowed
    return found


def test_design_md_draws_the_layer_table():
    # The page people read and the table the test keeps are one: a rule changed in either fails here.
    documented = documented_layers()
    assert set(documented) == set(MAY_IMPORT)
    assert {name: documented[name] for name in MAY_IMPORT} == {
        name: (None if allowed is None else set(allowed) - {name}) for name, allowed in MAY_IMPORT.items()}
