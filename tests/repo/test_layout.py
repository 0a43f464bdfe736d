"""The package's import graph: the tools (the bench command, the numerics module and CLI, the
demo) and the integrations with other libraries sit on top of the op, nothing below imports them,
and no modules import each other in a circle. Read from the source (every ``import`` statement,
also those inside functions); and importing the package imports none of the integrated libraries."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import mla_inductor

ROOT = pathlib.Path(mla_inductor.__file__).parent
TOOLS = ("mla_inductor.bench", "mla_inductor.demo", "mla_inductor.numerics", "mla_inductor.integrations")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = ["mla_inductor", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
    """The package modules ``name`` imports, at the top or inside a function: ``from a import b``
    counts as ``a.b`` when that is a module, else as ``a``. Its own ancestor packages count too:
    a submodule that takes a name from its package (``from . import X``, X not a module) closes a
    circle with the package that imports it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
    return {m for m in found if m in modules and m != name}


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _is_tool(name: str) -> bool:
    return any(name == t or name.startswith(t + ".") for t in TOOLS)


def test_graph_is_read_from_the_source():
    graph = _graph()
    assert "mla_inductor.custom_ops" in graph["mla_inductor.api"]
    assert "mla_inductor.bench.timing" in graph["mla_inductor.bench.fwd"]
    assert "mla_inductor.kernels.reference" in graph["mla_inductor.kernels.emulate"]
    # inside a function
    lazy = graph["mla_inductor.kernels.sm90.lightning_indexer_host"]
    assert "mla_inductor.kernels.sm90.topk_host" in lazy


def test_a_name_taken_from_the_own_package_counts(tmp_path):
    """``from . import X`` (X a name, not a module) and ``from .. import Y`` inside a function are
    arrows to the ancestor packages."""
    path = tmp_path / "child.py"
    path.write_text("from . import LIMIT\n\ndef f():\n    from .. import cache\n"
                    "    from ... import backends\n")
    modules = _modules()
    found = _imports("mla_inductor.kernels.sm90.child", path, modules)
    assert found == {"mla_inductor.kernels.sm90", "mla_inductor.kernels.cache",
                     "mla_inductor.backends"}


def test_nothing_below_the_tools_imports_them():
    graph = _graph()
    below = {m: deps for m, deps in graph.items() if not _is_tool(m)}
    assert not {(m, dep) for m, deps in below.items() for dep in deps if _is_tool(dep)}


def test_the_integrations_reach_the_kernels_through_the_api():
    """An integration calls the public functions and ops, which check the arguments and choose
    the backend; importing a kernel module would pass both."""
    graph = _graph()
    assert not {(m, dep) for m, deps in graph.items() if m.startswith("mla_inductor.integrations")
                for dep in deps if dep.startswith("mla_inductor.kernels")}


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_importing_a_kernel_module_leaves_its_package_as_it_was():
    """Importing a submodule sets its package's attribute of that name: a kernel module named as
    one of its backend package's protocol functions (``sm90.indexer_target``) would replace the
    function the first time that kernel is compiled. Checked in a fresh process, importing every
    module of the kernel packages after the package."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import mla_inductor.kernels as kernels, mla_inductor.kernels.sm90 as sm90\n"
        "before = {p: dict(vars(p)) for p in (kernels, sm90)}\n"
        "for package in before:\n"
        "    for info in pkgutil.iter_modules(package.__path__):\n"
        "        try:\n"
        "            importlib.import_module(f'{package.__name__}.{info.name}')\n"
        "        except ImportError:\n"
        "            pass  # a backend's optional dependency\n"
        "print(sorted(f'{p.__name__}.{k}' for p, old in before.items() for k, v in old.items()\n"
        "             if vars(p).get(k) is not v and not k.startswith('__')))\n"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]"


def test_importing_the_package_imports_no_integrated_library():
    code = "import sys, mla_inductor; print(sorted({'transformers'} & set(sys.modules)))"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]"


def test_passing_checks_do_not_import_symbolic_shapes():
    """A fresh process's first op call must not pay for ``torch._check``'s import of torch's
    symbolic-shapes module (and sympy) when every check passes on concrete sizes."""
    code = (
        "import sys, torch\n"
        "from mla_inductor import layout, validation\n"
        "q = torch.zeros(2, 8, 3, 576, dtype=torch.bfloat16)\n"
        "kv = torch.zeros(2, 16, 1, 576, dtype=torch.bfloat16)\n"
        "idx = torch.zeros(2, 8, 1, 4, dtype=torch.int32)\n"
        "flat = layout.flatten(q, kv, idx, None, True, None)\n"
        "validation.check_forward_inputs(flat.q, flat.kv, flat.indices, flat.topk_length, 512)\n"
        "validation.check_features(flat.q, flat.q_positions, None)\n"
        "print('torch.fx.experimental.symbolic_shapes' in sys.modules, tuple(flat.q.shape))\n"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.split() == ["False", "(16,", "3,", "576)"]
