"""The runtime's modules import in one direction: no import circle, lazy (in-function) imports included, and no module
of a subpackage imports from a module that imports that subpackage."""
import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
PACKAGE = "vllm_hybrid"


def module_name(path: Path) -> str:
    parts = path.relative_to(RUNTIME).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def exists(name: str) -> bool:
    base = RUNTIME.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def broken(path: Path) -> list[str]:
    """Project imports in `path` (lazy ones included) whose module does not exist: a move left them behind."""
    name, out = module_name(path), []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(PACKAGE)):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if not exists(target):
                out.append(f"{name}:{node.lineno} from {'.' * node.level}{node.module or ''}")
        elif isinstance(node, ast.Import):
            out += [f"{name}:{node.lineno} import {a.name}" for a in node.names
                    if a.name.startswith(PACKAGE) and not exists(a.name)]
    return out


def imports(path: Path) -> set[str]:
    """The project modules `path` imports, wherever in it (a lazy import counts as much as one at the top)."""
    name, out = module_name(path), set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith(PACKAGE)}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith(PACKAGE):
                target = node.module
            else:
                continue
            for alias in node.names:  # `from . import x`: the submodule x where there is one
                sub = f"{target}.{alias.name}"
                out.add(sub if exists(sub) else target)
    return {m for m in out if exists(m) and m != name}


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in RUNTIME.rglob("*.py")}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
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

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_runtime_has_no_import_circle():
    g = graph()
    assert len(g) > 40 and "vllm_hybrid.strategies.coprocessor.client" in g  # the walk sees the whole tree
    assert cycles(g) == []


def test_every_project_import_names_a_module_that_exists():
    assert [b for p in sorted(RUNTIME.rglob("*.py")) for b in broken(p)] == []


def test_the_check_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_strategy_folders_keep_their_halves_apart():
    """The Strategy (a folder's __init__) is what the planner and launcher import: it never imports its vLLM patches
    or its CPU pod's server at module level, so planning needs neither torch nor vLLM."""
    for folder in ("balanced", "coprocessor", "experts"):
        init = RUNTIME / PACKAGE / "strategies" / folder / "__init__.py"
        top = [n for n in ast.parse(init.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {n.module for n in top if isinstance(n, ast.ImportFrom)} | {a.name for n in top for a in n.names}
        assert not names & {"patches", "server", "client", "gemm_split", "gemm_helper", "kernels", "tune", "torch"}, (
            folder, names)
