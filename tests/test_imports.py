"""Imports point down (DESIGN.md, "Layout"): no module imports one that imports it back, by any path, and a room
imports a room on a higher floor only where the reason is written below (UPWARD).

Read from the source with ast, every import counted, also those inside a function (a late import is still an
arrow): the package, scripts/, data/*/prepare.py and the entry points, without importing any of them (well under
a second). A room is a top-level module or package of torchtitan/ (each model family its own), a folder of scripts/,
or an entry point. Print the rooms' arrows with `python -m tests.test_imports`.
"""

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("torchtitan", "scripts", "data", "train.py", "sample.py", "cosmos_latent_decoder.py")

# DESIGN's floors, bottom up: scripts -> trainer -> models/dp/datasets/components -> parallelisms/kernels/tools ->
# errors. Floor 3 is the registry and the config's parsing and checks, which read every family's args.
FLOORS = {
    "torchtitan.errors": 0,
    "torchtitan.protocols": 0,
    "torchtitan.job_config": 0,
    "torchtitan.job_config_dit": 0,
    "torchtitan.tools": 1,
    "torchtitan.parallelisms": 1,
    "torchtitan.kernels": 1,
    "torchtitan.diffusion": 2,
    "torchtitan.alignment": 2,
    "torchtitan.datasets": 2,
    "torchtitan.dp": 2,
    "torchtitan.components": 2,
    "torchtitan.models.dit": 2,
    "torchtitan.models.llama3": 2,
    "torchtitan.models": 2,
    "torchtitan.train_spec": 3,
    "torchtitan.config_validation": 3,
    "torchtitan.config_validation_dit": 3,
    "torchtitan.config_manager": 3,
    "torchtitan.trainer": 4,
    "torchtitan.measure": 4,
    "train": 5,
    "sample": 5,
    "cosmos_latent_decoder": 5,
    "data": 5,
    "scripts": 5,
    "scripts.lib": 5,
    "scripts.dp": 5,
    "scripts.benchmarks": 5,
}

# The arrows that run up a floor, each with its reason; an arrow not listed here fails, and so does a reason whose
# arrow is gone.
UPWARD = {
    ("torchtitan.kernels", "torchtitan.models.dit"): "kernels/dit_modules.py: a converter swaps the DiT's own "
    "modules for fused ones with the same parameter names (STYLE 14), so it names the classes it replaces; the model "
    "never imports a kernel",
    ("torchtitan.tools", "torchtitan.models.dit"): "tools/memory_estimate.py: the estimate is a closed form of the "
    "DiT's args (DiTArgs, its flavors); DESIGN keeps the memory estimate in tools/, and only the trainer and scripts "
    "import it",
    ("torchtitan.tools", "torchtitan.models.llama3"): "tools/memory_estimate*.py: the same closed form for Llama 3's "
    "args and flavors",
    ("torchtitan.tools", "torchtitan.train_spec"): "tools/memory_estimate.py: the estimate of a config builds the "
    "model args through the registry, as the trainer does, so both size the same model",
    ("torchtitan.tools", "torchtitan.config_manager"): "tools/batch_size_finder.py (DESIGN: tools/): "
    "`training.local_batch_size = 'auto'` probes the resolved config in fresh trainer processes, so it parses "
    "and writes configs; only the trainer and scripts import it",
    ("torchtitan.models.dit", "torchtitan.config_manager"): "models/dit/weights.py (DESIGN: the readers of published "
    "formats) also opens a run folder, whose model its config.toml defines; only sample.py and "
    "scripts/convert_dit.py import it",
    ("torchtitan.models.dit", "torchtitan.train_spec"): "models/dit/weights.py builds a run's model args through the "
    "registry, as the run's trainer built them",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "torchtitan" and len(parts) > 1:
        depth = 3 if parts[1] == "models" and len(parts) > 2 else 2
        return ".".join(parts[:depth])
    if parts[0] == "scripts":
        return ".".join(parts[:2]) if len(parts) > 1 and (ROOT / "scripts" / parts[1]).is_dir() else "scripts"
    return parts[0]


@functools.cache
def import_graph() -> dict[str, dict[str, str]]:
    """module -> {imported module of ours: 'file:line' of the first such import}."""
    files = [p for s in SOURCES for p in ((ROOT / s).rglob("*.py") if (ROOT / s).is_dir() else [ROOT / s])]
    modules = {module_name(p): p for p in files}
    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        arrows = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from package import module` imports the module; `from module import name`, the module
                targets = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules] or [base]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != module and target != "torchtitan":
                    arrows.setdefault(target, f"{path.relative_to(ROOT)}:{node.lineno}")
        graph[module] = arrows
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str]:
    """One circle of modules (each followed by the line importing the next), or [] when there is none."""
    state, stack = {}, []

    def visit(module: str) -> list[str]:
        state[module] = "open"
        stack.append(module)
        for target in graph.get(module, {}):
            if state.get(target) == "open":
                loop = stack[stack.index(target) :] + [target]
                return [f"{a} ({graph[a][b]})" for a, b in zip(loop, loop[1:])] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[module] = "done"
        stack.pop()
        return []

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return []


def room_arrows(graph: dict[str, dict[str, str]]) -> dict[tuple[str, str], list[str]]:
    """(room, room it imports) -> the lines that import it."""
    arrows = defaultdict(list)
    for module, targets in graph.items():
        for target, where in targets.items():
            if room_of(module) != room_of(target):
                arrows[room_of(module), room_of(target)].append(where)
    return arrows


def test_no_module_imports_itself_back():
    cycle = find_cycle(import_graph())
    assert not cycle, "an import circle: " + " -> ".join(cycle)


def test_a_circle_is_found_and_named():
    # The check itself: a circle through a late import (as config_validation -> train_spec -> models ran) is found.
    graph = {"a": {"b": "a.py:3"}, "b": {"c": "b.py:5"}, "c": {"a": "c.py:80"}, "d": {"a": "d.py:1"}}
    assert find_cycle(graph) == ["a (a.py:3)", "b (b.py:5)", "c (c.py:80)", "a"]
    assert find_cycle({"a": {"b": "a.py:3"}, "b": {}}) == []


def test_every_room_has_a_floor():
    rooms = {room_of(module) for module in import_graph()} - {"torchtitan"}
    assert not rooms - FLOORS.keys(), f"rooms without a floor in FLOORS: {sorted(rooms - FLOORS.keys())}"


def test_arrows_point_down_or_say_why():
    arrows = room_arrows(import_graph())
    upward = {pair: lines for pair, lines in arrows.items() if FLOORS[pair[0]] < FLOORS[pair[1]]}
    unexplained = {f"{a} -> {b}": lines for (a, b), lines in upward.items() if (a, b) not in UPWARD}
    assert not unexplained, f"upward arrows without a reason in UPWARD: {unexplained}"
    stale = [f"{a} -> {b}" for a, b in UPWARD if (a, b) not in upward]
    assert not stale, f"reasons in UPWARD for arrows that are gone: {stale}"


def test_a_model_imports_only_its_own_family():
    # DESIGN: a model never imports kernels, DP, parallelism, logging or config objects.
    graph = import_graph()
    for path in sorted((ROOT / "torchtitan" / "models").glob("*/model.py")):
        family = module_name(path).rpartition(".")[0]
        ours = [t for t in graph[module_name(path)] if not t.startswith(family + ".")]
        assert not ours, f"{path.relative_to(ROOT)} imports {ours}"


if __name__ == "__main__":
    for (source, target), lines in sorted(room_arrows(import_graph()).items()):
        up = "  UP" if FLOORS.get(source, 9) < FLOORS.get(target, 9) else ""
        print(f"{source} -> {target}{up}  ({len(lines)}: {lines[0]})")
