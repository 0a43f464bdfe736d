"""Every relative link of README.md and docs/**/*.md resolves.

A link ``[text](target)`` outside code (fenced blocks and inline code spans are skipped) whose
target has no scheme (``https:``, ``mailto:``) must name a file or folder of the repository,
relative to the file it is in; with ``#anchor`` (or an anchor alone, into the same file) the
target must be a Markdown file with a heading of that anchor. Anchors follow GitHub's rule: the
heading's text, lower-cased, with everything but letters, digits, ``_``, ``-`` and spaces
removed, spaces turned into ``-``, and ``-1``, ``-2`` ... appended to repeats.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+).*?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` for the lines outside fenced code blocks."""
    found, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            found.append((n, line))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text (before repeats are numbered)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of the Markdown file ``path``, repeats numbered as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """``(line number, target)`` of every link of ``path`` outside code."""
    found = []
    for n, line in prose_lines(path.read_text()):
        for m in LINK.finditer(CODE_SPAN.sub("", line)):
            found.append((n, m.group(1)))
    return found


def broken(path: Path, root: Path = ROOT) -> list[str]:
    """``"file:line: target (why)"`` for every relative link of ``path`` (a file under ``root``)
    that does not resolve."""
    found = []
    for n, target in links(path):
        if not target or SCHEME.match(target):
            continue
        name, _, anchor = target.partition("#")
        dest = (path.parent / name).resolve() if name else path
        where = f"{path.relative_to(root)}:{n}: {target}"
        if not dest.exists():
            found.append(f"{where} (no such file)")
        elif not dest.is_relative_to(root):
            found.append(f"{where} (outside the repository)")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            found.append(f"{where} (no such heading)")
    return found


@pytest.mark.parametrize("heading, anchor", [
    ("The indexer's training signal", "the-indexers-training-signal"),
    ("Indexer loss (opt-in)", "indexer-loss-opt-in"),
    ("The DeepSeek-V3.2 layer", "the-deepseek-v32-layer"),
    ("Distributed (DTensor)", "distributed-dtensor"),
    ("torch.compile and inductor", "torchcompile-and-inductor"),
    ("`sparse_mla`", "sparse_mla"),
])
def test_slug_is_githubs(heading, anchor):
    assert slug(heading) == anchor


def test_broken_links_are_found(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n\n## A part\n\n## A part\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc\n\n[ok](other.md#a-part) [ok](other.md#a-part-1) [ok](#doc) [web](https://x.y/#z)\n"
        "`[code](missing.md)`\n```text\n[fenced](missing.md)\n```\n"
        "[gone](missing.md) [bad](other.md#a-part-2) [self](#nothing)\n")
    assert [b.split(": ", 1)[1] for b in broken(doc, tmp_path)] == [
        "missing.md (no such file)", "other.md#a-part-2 (no such heading)",
        "#nothing (no such heading)"]


def test_docs_have_links():
    assert sum(len(links(p)) for p in DOCS) >= 20


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_relative_links_resolve(path):
    assert broken(path) == []
