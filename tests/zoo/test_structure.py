"""The shape of the ``zoo`` package, read from its source: no import cycle, floors that imports only go down,
imports at the top of a module (except optional extras, loaded only when asked for), short functions, and a
short training loop; and ``kernels/`` holds tensor functions only, not the tools that drive them."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "zoo"
#: optional extras: imported inside the function that needs them, so the zoo imports without them
OPTIONAL = {"ray", "wandb", "torch.utils.tensorboard", "datasets", "tokenizers", "transformers", "lm_eval", "zoo.hf"}
#: the hf extra's own package: its modules import transformers at their top, since nothing imports zoo.hf at the
#: top of a module (the zoo.hf case of the extras test checks it)
EXTRA_PACKAGE = "zoo.hf"
#: a script the ledger runs inside a checkout of an older commit: it must import that commit's modules, in
#: whichever layout the commit has, inside its functions; nothing in the zoo imports it
OTHER_COMMITS_SCRIPT = "zoo.experiments.probe"
MAX_FUNCTION_LINES = 80
#: the floors inside zoo: the modules of a package on the left never import those of a package on the right
#: (results rows, errors and the environment record stand on the ground floor, below all of them)
FLOORS = {"zoo.training": ("zoo.experiments",),
          "zoo.tasks": ("zoo.training", "zoo.experiments"),
          "zoo.data": ("zoo.training", "zoo.experiments")}
GROUND_FLOOR = ("zoo.rows", "zoo.errors", "zoo.environment")
MAX_TRAIN_LINES = 60


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``name`` imports anywhere (at the top or inside a function)."""
    is_package = (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(name, node, is_package)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
    return out & known


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_of_zoo_has_no_cycle():
    modules = _modules()
    graph = {name: _imports(name, tree, set(modules)) - {name} for name, tree in modules.items()
             if name != OTHER_COMMITS_SCRIPT}
    assert not any(OTHER_COMMITS_SCRIPT in imports for imports in graph.values())
    assert len(graph) > 20 and any(graph.values())  # the walk found the package and its imports
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _upward(graph: dict[str, set[str]], floors: dict[str, tuple[str, ...]]) -> list[str]:
    """``importer -> imported`` for every import that goes from a package up to one it must not import."""
    return sorted(f"{name} -> {target}" for name, imports in graph.items() for package, above in floors.items()
                  if _within(name, package) for target in imports if any(_within(target, a) for a in above))


def test_imports_inside_zoo_only_go_down_the_floors():
    modules = _modules()
    graph = {name: _imports(name, tree, set(modules)) - {name} for name, tree in modules.items()}
    assert any(_within(m, "zoo.training") for m in graph) and any(_within(m, "zoo.tasks") for m in graph)
    assert not _upward(graph, FLOORS), "imports up a floor: " + "; ".join(_upward(graph, FLOORS))
    ground = {name: graph[name] for name in GROUND_FLOOR}
    assert all(imports <= set(GROUND_FLOOR) for imports in ground.values()), f"the ground floor imports {ground}"


def test_the_floor_check_finds_an_upward_import():
    graph = {"zoo.training.evaluation": {"zoo.experiments.rows", "zoo.rows"}, "zoo.tasks.lm": {"zoo.data.windows"},
             "zoo.data.windows": {"zoo.training.device"}, "zoo.experiments.ablate": {"zoo.training.loop"}}
    assert _upward(graph, FLOORS) == ["zoo.data.windows -> zoo.training.device",
                                      "zoo.training.evaluation -> zoo.experiments.rows"]


def test_kernels_holds_no_tool_that_drives_the_launchers():
    # kernels/ is pure tensor functions; the compile check, which drives every launcher, is a benchmark tool
    tools = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "kernels").rglob("compile_check.py"))
    assert not tools, f"{tools}: tools that drive the kernels live in zoo/benchmark/, not in kernels/"


def test_imports_stand_at_the_top_of_a_module_except_optional_extras():
    late = []
    for name, tree in _modules().items():
        if name == OTHER_COMMITS_SCRIPT:
            continue
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    targets = [node.module or ""] if not node.level else ["." * node.level + (node.module or "")]
                else:
                    continue
                late += [f"{name}.{fn.name}: {t}" for t in targets
                         if not any(t == o or t.startswith(o + ".") for o in OPTIONAL)]
    assert not late, "imports inside functions (move them to the top of the module): " + "; ".join(late)


def test_no_function_in_zoo_is_long_and_train_is_short():
    long = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name} ({lines} lines)")
                if name == "zoo.training.loop" and node.name == "train":
                    assert lines <= MAX_TRAIN_LINES, f"train() has {lines} lines"
    assert not long, "functions over 80 lines: " + ", ".join(long)


@pytest.mark.parametrize("extra", sorted(OPTIONAL))
def test_optional_extras_are_not_needed_to_import_the_zoo(extra):
    # every optional extra is either absent here or imported only inside the function that uses it
    for name, tree in _modules().items():
        if name == EXTRA_PACKAGE or name.startswith(EXTRA_PACKAGE + "."):
            continue
        for node in tree.body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not any(n == extra or n.startswith(extra + ".") for n in names)
