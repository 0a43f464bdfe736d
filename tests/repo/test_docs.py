"""Every Python code block of README.md and docs/**/*.md runs as written, on the CPU.

Each block runs as a script of its own in a fresh interpreter (the repository root as the working
directory and on ``PYTHONPATH``), so a block uses only the names it defines. An HTML comment on
the line before a block's opening fence changes how it is run (docs/testing.md):

- ``<!-- docs-test: gpu -->``: needs a CUDA GPU; skipped without one, run with one.
- ``<!-- docs-test: torchrun 2 -->``: a distributed script; launched as
  ``torchrun --standalone --nproc-per-node 2 <script>`` (gloo on the CPU).
- ``<!-- docs-test: needs transformers -->``: skipped when transformers is not installed.

The scripts of ``examples/`` run the same way, their marker a first line ``# docs-test: <marker>``.

Blocks fenced as anything but ``python`` (``bash``, ``text``) are not run.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARKER = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
KNOWN = ("gpu", "torchrun 2", "needs transformers")
# Appended to a torchrun block, the way ``mla_inductor.bench.ranks`` ends its ranks (its file
# barrier): once the block has ended (after its ``destroy_process_group``), every rank waits until
# all have got here, then the process ends without the interpreter's shutdown. Leaving through
# that shutdown, a gloo rank now and then died with "terminate called without an active
# exception" (SIGABRT) after the block had passed (CI on 2 cores, 2026-12-01 and 2026-12-03). A
# block that raises never gets here, and fails.
LEAVE = """
import os as _os, sys as _sys
from mla_inductor.bench.ranks import _all_reached
_all_reached(_os.path.dirname(_os.path.abspath(__file__)), "left", int(_os.environ["RANK"]),
             int(_os.environ["WORLD_SIZE"]))
_sys.stdout.flush()
_sys.stderr.flush()
_os._exit(0)
"""


def python_blocks(path: Path) -> list[tuple[int, str, str]]:
    """``(line of the opening fence, marker or "", source)`` for every ```` ```python ```` block
    of ``path``; the marker is the ``docs-test:`` comment on the line before the fence."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if m.group(1) == "python":
            before = MARKER.search(lines[i - 1]) if i else None
            found.append((i + 1, before.group(1) if before else "", "\n".join(lines[i + 1:end])))
        i = end + 1
    return found


EXAMPLE_MARKER = re.compile(r"^#\s*docs-test:\s*(.*?)\s*$")
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def example_block(path: Path) -> tuple[int, str, str]:
    """``(1, marker or "", source)`` of a script of ``examples/``: its marker is a first line
    ``# docs-test: <marker>``, as the line before a docs block's fence."""
    src = path.read_text()
    m = EXAMPLE_MARKER.match(src.splitlines()[0]) if src else None
    return 1, m.group(1) if m else "", src


BLOCKS = ([(p, line, marker, src) for p in DOCS for line, marker, src in python_blocks(p)]
          + [(p, *example_block(p)) for p in EXAMPLES])


def test_markers_are_known():
    for path in DOCS:
        for n, text in enumerate(path.read_text().splitlines(), 1):
            for m in MARKER.finditer(text):
                assert m.group(1) in KNOWN, f"{path.name}:{n}: unknown marker {m.group(1)!r}"
    for path in EXAMPLES:
        assert example_block(path)[1] in ("", *KNOWN), f"{path.name}: unknown marker"


def test_every_example_is_linked_from_the_docs():
    linked = "".join(p.read_text() for p in DOCS)
    assert EXAMPLES and all(f"examples/{p.name}" in linked for p in EXAMPLES)


def test_every_doc_has_blocks_found():
    assert any(p.name == "README.md" for p, *_ in BLOCKS)
    assert len(BLOCKS) >= 8, [(p.name, line) for p, line, *_ in BLOCKS]


def test_fences_have_three_backticks():
    """An opening or closing fence of one or two backticks renders as text, not as a block."""
    short = re.compile(r"^`{1,2}\w*\s*$")
    found = [(p.name, n) for p in DOCS for n, text in enumerate(p.read_text().splitlines(), 1)
             if short.match(text)]
    assert found == []


COUNTS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5}


def counted_headings(path: Path) -> list[tuple[int, int, list[str]]]:
    """``(line, the count a heading names, the commands of the block after it)`` for every
    heading of ``path`` that names a number of commands ("## Three commands on ..."); the
    commands are the block's lines that are neither blank nor comments."""
    lines = path.read_text().splitlines()
    found = []
    for n, text in enumerate(lines):
        m = re.match(r"^#+ (\w+) commands\b", text, re.IGNORECASE)
        if not m or m.group(1).lower() not in COUNTS:
            continue
        start = next(j for j in range(n + 1, len(lines)) if FENCE.match(lines[j]))
        end = next(j for j in range(start + 1, len(lines)) if lines[j].startswith("```"))
        commands = [c for c in lines[start + 1:end] if c.strip() and not c.startswith("#")]
        found.append((n + 1, COUNTS[m.group(1).lower()], commands))
    return found


def test_a_heading_that_counts_commands_shows_as_many():
    found = [(p.name, *h) for p in DOCS for h in counted_headings(p)]
    assert any(name == "README.md" for name, *_ in found)
    assert [(name, line, count) for name, line, count, commands in found
            if len(commands) != count] == []


def torch_installs(text: str) -> list[str]:
    """The version of every ``pip install ... torch==<version>`` line."""
    return re.findall(r"pip install (?:-q )?torch==(\S+)", text)


def test_readme_installs_the_torch_that_ci_tests():
    """The README's torch line is the one release .ci/run installs and tests."""
    readme = torch_installs((ROOT / "README.md").read_text())
    ci = torch_installs((ROOT / ".ci" / "run").read_text())
    assert len(ci) == 1 and readme == ci


def imports(src: str) -> list[str]:
    """Every import statement of ``src``, unparsed (``from a import b as c``), in order."""
    return [ast.unparse(node) for node in ast.walk(ast.parse(src))
            if isinstance(node, (ast.Import, ast.ImportFrom))]


def test_imports_catches_a_repeated_import():
    src = "import torch\nfrom a import b as c\nx = 1\nfrom a import b as c\n"
    assert imports(src) == ["import torch", "from a import b as c", "from a import b as c"]


def test_no_block_imports_a_name_twice():
    repeated = [(p.name, line, stmt) for p, line, _, src in BLOCKS
                for stmt in set(imports(src)) if imports(src).count(stmt) > 1]
    assert repeated == []


@pytest.mark.parametrize(
    "path, line, marker, src", BLOCKS, ids=[f"{p.name}:{line}" for p, line, _, _ in BLOCKS])
def test_block_runs(path, line, marker, src, tmp_path):
    if marker == "gpu" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if marker == "needs transformers" and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers (the transformers or test extra)")
    script = tmp_path / "block.py"
    script.write_text(src + "\n" + (LEAVE if marker == "torchrun 2" else ""))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                    os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", "1")
    if marker == "torchrun 2":
        # torchrun is this module's console script: the same launcher, this interpreter
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", str(script)]
    else:
        cmd = [sys.executable, str(script)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (
        f"{path.name}:{line} exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}"
        f"\n--- stderr\n{done.stderr[-6000:]}")
