"""The layering of docs/design.md, executable: no package imports one the table puts below it.

Every module under platform/tenantq is parsed with `ast`; every `import` and `from ... import`
counts, including those inside functions (a lazy import is still a dependency), and so does a
path built into another package's folder (`... / "reference"`). A failure names the file,
the line and the import, and says what that package may import. Inside a package, modules
import each other without circles (a cycle means two modules are one concept split in two,
or a registry filled by import side effects).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "platform" / "tenantq"
DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"

# The design's "Rooms" table, top to bottom: a package imports only packages above it. `cli`
# and `bench` share the bottom row ("all"). `testing` (the shared tiny fixtures, not in the
# table) sits right below `model`, the only package it uses. Top-level modules
# (tenantq/__init__.py, tenantq/__main__.py) dispatch to the CLI and count as `cli`.
ORDER = (
    "numerics",
    "model",
    "testing",
    "quant",
    "storage",
    "export",
    "engine",
    "capacity",
    "reference",
    "evals",
    "tracking",
    "workers",
    "search",
    "report",
    ("cli", "bench"),
)
LEVEL = {
    name: level
    for level, row in enumerate(ORDER)
    for name in (row if isinstance(row, tuple) else (row,))
}
# DESIGN.md: "numerics and capacity import no Ray and no MLflow; engine imports no Optuna";
# evals is a library of measurements that any driver may call.
FORBIDDEN_THIRD_PARTY = {
    "numerics": {"ray", "mlflow", "optuna"},
    "capacity": {"ray", "mlflow", "optuna"},
    # docs/design.md: what one chip stores is pure Python, read by the planner without JAX.
    "storage": {"jax", "ray", "mlflow", "optuna"},
    "engine": {"optuna"},
    "evals": {"optuna", "ray", "mlflow"},
}


def _package_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else "cli"


def _imports(path: Path, root: Path):
    """(line, dotted module) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module_parts = ["tenantq", *path.relative_to(root).with_suffix("").parts]
    if module_parts[-1] == "__init__":
        module_parts = module_parts[:-1]
        package_parts = module_parts
    else:
        package_parts = module_parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            if module == "tenantq":  # from tenantq import engine: the named subpackages
                for alias in node.names:
                    yield node.lineno, f"tenantq.{alias.name}"
            else:
                yield node.lineno, module
        elif (  # Path(__file__).parents[1] / "reference": a reach-in by path is an import too
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Div)
            and isinstance(node.right, ast.Constant)
            and node.right.value in LEVEL
        ):
            yield node.lineno, f"tenantq.{node.right.value}"


def layering_violations(root: Path = PACKAGE) -> list[str]:
    problems = []
    for path in sorted(root.rglob("*.py")):
        package = _package_of(path, root)
        level = LEVEL.get(package)
        shown = path.relative_to(root.parents[1])
        if level is None:
            problems.append(f"{shown}: package {package!r} is not in DESIGN.md's table")
            continue
        allowed = [n for n, lv in LEVEL.items() if lv < level]
        for line, module in _imports(path, root):
            top = module.split(".")[0]
            if top in FORBIDDEN_THIRD_PARTY.get(package, ()):
                problems.append(
                    f"{shown}:{line}: imports {module}; DESIGN.md: {package} imports no {top}"
                )
            if top != "tenantq" or module == "tenantq":
                continue
            target = module.split(".")[1]
            if target == package or target not in LEVEL:
                continue  # own package, or a top-level module such as tenantq.__main__
            if LEVEL[target] > level or (LEVEL[target] == level and target != package):
                if {target, package} == {"cli", "bench"}:
                    continue  # the bottom row uses everything
                problems.append(
                    f"{shown}:{line}: imports {module}; {package} may import only "
                    f"{', '.join(allowed) or 'nothing of tenantq'} (DESIGN.md's table)"
                )
    return problems


def _module_name(path: Path, root: Path) -> str:
    return ".".join(["tenantq", *path.relative_to(root).with_suffix("").parts])


def _from_imports(tree: ast.AST, package: str):
    """(module, names) of every `from ... import` in `tree`, relative ones resolved against
    `package` (the dotted package the file is in)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):  # relative: resolved as _imports does
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            yield (
                ".".join([*base, node.module] if node.module else base),
                [a.name for a in node.names],
            )


def import_cycles(root: Path = PACKAGE) -> list[list[str]]:
    """Cycles among the modules of one package (lazy imports count, `__init__` files do not:
    importing any submodule runs them, so they are the package's door, not a room in it).
    Each cycle is its modules, sorted; `from pkg import mod` counts as importing `pkg.mod`,
    and `from pkg import Name` as importing the module `pkg/__init__.py` takes `Name` from."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py") if p.name != "__init__.py"}
    door: dict[str, str] = {}  # "pkg.Name" -> the module of pkg that pkg/__init__.py takes it from
    for init in root.rglob("__init__.py"):
        package = ".".join(["tenantq", *init.parent.relative_to(root).parts])
        for module, names in _from_imports(ast.parse(init.read_text()), package):
            for alias in names:
                source = module if module in modules else f"{module}.{alias}"
                if source in modules and source.rsplit(".", 1)[0] == package:
                    door[f"{package}.{alias}"] = source
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        targets: list[str] = []
        for module, names in _from_imports(tree, package):
            named = [f"{module}.{a}" for a in names]
            targets += [module, *named, *(door[n] for n in named if n in door)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
        for target in targets:
            if target in modules and target != name and target.rsplit(".", 1)[0] == package:
                graph[name].add(target)
    # Tarjan's strongly connected components: every component of two or more is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
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
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_no_package_imports_one_below_it() -> None:
    problems = layering_violations()
    assert not problems, "layering violations:\n" + "\n".join(problems)


def test_the_checker_sees_lazy_relative_and_from_imports(tmp_path: Path) -> None:
    # A checker that missed function-level or relative imports would pass a wrong tree.
    root = tmp_path / "platform" / "tenantq"
    for name, body in {
        "numerics/__init__.py": "",
        "numerics/codec.py": "def f():\n    from tenantq.engine import Engine\n",
        "model/__init__.py": "from ..quant import plan\n",
        "quant/__init__.py": "import ray\n",
        "engine/__init__.py": "from tenantq import capacity\nimport optuna\n",
        "capacity/__init__.py": "from tenantq.quant.plan import QuantPlan\nimport mlflow\n",
        "capacity/presets.py": "import pathlib\nP = pathlib.Path('.') / 'reference'\n",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(body)
    found = "\n".join(layering_violations(root))
    assert "numerics/codec.py:2: imports tenantq.engine" in found
    assert "model/__init__.py:1: imports tenantq.quant" in found
    assert "engine/__init__.py:1: imports tenantq.capacity" in found
    assert "engine/__init__.py:2: imports optuna" in found
    assert "capacity/__init__.py:2: imports mlflow" in found
    assert "capacity/__init__.py:1" not in found  # capacity may use quant
    assert "capacity/presets.py:2: imports tenantq.reference" in found
    assert "quant/__init__.py" not in found  # quant may use Ray (DESIGN bans it elsewhere)


def test_the_order_matches_the_design_doc() -> None:
    # docs/design.md is in the repository, so this runs in every clone (no skip): the table's
    # rows, top to bottom, must be ORDER less `testing` (which the table does not list).
    rows = re.findall(r"^\| `([a-z]+)`(?:, `([a-z]+)`)? \|", DESIGN.read_text(), flags=re.M)
    design = [r[0] if not r[1] else (r[0], r[1]) for r in rows]
    assert design, f"{DESIGN}: no package table found"
    assert design == [row for row in ORDER if row != "testing"]


def test_no_import_cycle_inside_a_package() -> None:
    cycles = import_cycles()
    assert not cycles, "import cycles (modules that import each other, lazily or not):\n" + (
        "\n".join(" <-> ".join(c) for c in cycles)
    )


def test_the_cycle_check_sees_lazy_and_relative_imports_around_a_loop(tmp_path: Path) -> None:
    # a -> b at module level, b -> c lazily, c -> a relatively: one cycle of three; d imports
    # a one way only and the package door (__init__) imports everything without making one.
    root = tmp_path / "platform" / "tenantq"
    for name, body in {
        "quant/__init__.py": "from tenantq.quant import a, b, c, d\n",
        "quant/a.py": "from tenantq.quant.b import f\n",
        "quant/b.py": "def f():\n    from tenantq.quant import c\n",
        "quant/c.py": "from .a import g\n",
        "quant/d.py": "import tenantq.quant.a\nfrom tenantq.quant import x\n",
        "model/e.py": "from tenantq.quant import d\n",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(body)
    assert import_cycles(root) == [["tenantq.quant.a", "tenantq.quant.b", "tenantq.quant.c"]]


def test_the_cycle_check_sees_a_loop_through_the_package_door(tmp_path: Path) -> None:
    # `from tenantq.engine import Engine` inside engine/cache.py runs engine/__init__.py, which
    # imports engine/engine.py: a loop cache -> engine -> cache, though no module is named.
    # The door's own re-exports say which module a name comes from.
    root = tmp_path / "platform" / "tenantq"
    for name, body in {
        "engine/__init__.py": "from tenantq.engine.engine import Engine\nfrom .cache import C\n",
        "engine/engine.py": "from tenantq.engine.cache import C\n",
        "engine/cache.py": "def f():\n    from tenantq.engine import Engine\n",
        "engine/pool.py": "from tenantq.engine import C, missing\n",  # one way: no loop
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(body)
    assert import_cycles(root) == [["tenantq.engine.cache", "tenantq.engine.engine"]]
