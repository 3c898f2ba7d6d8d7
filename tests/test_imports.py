"""Imports flow one way (`docs/design.md`, "Packages"): `pallas_kernels` imports neither
`gemma` nor `swajax`, `gemma` never imports `swajax`, no module imports itself through others
(every import counted, module-level or inside a function), the scheduler's side of the engine
imports no JAX, and the public API stays small.

The graph is read from the source (`ast`), so a lazy import inside a function counts as much as
one at the top: a cycle through a function-local import is still a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("swajax", "gemma", "pallas_kernels")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _first_party(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str) -> set[str]:
    """The first-party modules `name` imports anywhere in its source (packages included: a
    submodule import runs its package's `__init__`), and the third-party top-level names."""
    path = MODULES[name]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            if t.split(".")[0] in PACKAGES:
                found = _first_party(t)
                if found and found != name:
                    out.add(found)
            else:
                out.add(t.split(".")[0])
    return out


GRAPH = {m: imports_of(m) for m in MODULES}


def test_no_upward_imports():
    upward = [
        (a, b)
        for a, deps in GRAPH.items()
        for b in deps
        if (a.startswith("gemma") and b.startswith("swajax"))
        or (a.startswith("pallas_kernels") and b.split(".")[0] in ("gemma", "swajax"))
    ]
    assert upward == []


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in graph:
                continue
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
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_walker_sees_cycles_and_upward_edges():
    """The checks above can fail: a made-up graph with a cycle through a lazy import."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    # a function-local import is an edge: `RequestAPI` imports tqdm only inside `run`
    assert (
        "tqdm" in GRAPH["swajax._request_api"] and "swajax._scheduler" in GRAPH["swajax._replicas"]
    )


@pytest.mark.parametrize(
    "module", ["swajax._scheduler", "swajax._ledger", "swajax._prefix_cache", "gemma._hook"]
)
def test_host_side_modules_import_no_jax(module):
    """The scheduler, the slot ledger, the prefix cache and the hook contract are pure Python:
    importing one (in a fresh process) loads neither JAX nor Flax."""
    code = (
        f"import sys, {module}; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib', 'flax'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize(
    "first", ["from pallas_kernels import kv_write_reference", "import pallas_kernels.kv_write"]
)
def test_kernel_exports_are_functions_whatever_was_imported_first(first):
    """`pallas_kernels.kv_write` names both a submodule and its function: once the submodule is
    imported (by a test, or through another export), the engine's attention hook still gets the
    function (an H100 run of the GPU tests failed on the module), and so does the package's
    lazy export unless the submodule itself was imported by name (Python then binds it)."""
    code = (
        f"{first}\n"
        "import swajax._paged as p\n"
        "from pallas_kernels import kv_write\n"
        "print(callable(p.kv_write), callable(kv_write))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    hook, export = out.stdout.split()
    assert hook == "True" and (export == "True" or first.startswith("import ")), out.stdout


def test_public_api_is_small_and_importable():
    import swajax

    names = [n for n in swajax.__all__ if n not in ("cli", "jsonl", "plan", "pool")]
    assert 8 <= len(names) <= 15, names
    for name in swajax.__all__:
        assert getattr(swajax, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'make_layout'"):
        swajax.make_layout  # noqa: B018 - the pool's algebra lives in swajax.pool
    assert swajax.pool.make_layout and swajax.pool.BAD == -1


def _private_attribute_uses(tree: ast.AST) -> set[str]:
    """`pkg._mod` of every attribute chain `pkg._mod.name` in code (not in strings)."""
    used = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in PACKAGES
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            used.add(f"{node.value.id}.{node.attr}")
    return used


def _imported(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                out.update(".".join(parts[: i + 1]) for i in range(len(parts)))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize("folder", ["tests", "experiments"])
def test_private_modules_are_imported_where_they_are_used(folder):
    """The packages' `__init__`s are lazy: `swajax._runner` is an attribute of `swajax` only
    once something imported it. A test or script that reads `pkg._mod.x` imports `pkg._mod`
    itself, so it does not depend on which module happened to import it first (GPU-only tests
    never run here; this is how their imports are checked)."""
    missing = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        absent = _private_attribute_uses(tree) - _imported(tree)
        missing += [f"{path.relative_to(ROOT)}: {m}" for m in sorted(absent)]
    assert not missing, missing
