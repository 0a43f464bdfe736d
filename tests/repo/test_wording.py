"""The repository speaks of the product alone: no tracker numbers without a tracker, no counts
of work periods, no notes about where or with what it was made, no paths outside it.

Every tracked text file (``git ls-files``; this file excepted, since it lists the patterns) is
read line by line against :data:`PATTERNS` (case-insensitive). A measurement says its hardware,
software versions and date, and nothing else about its origin.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PATTERNS = {
    r"\bissues? #?\d+\b(?!-)": "a tracker number ('issue 15'; 'issue 16-byte stores' is fine)",
    r"(?<![\w/.-])#\d+\b": "a bare tracker reference ('#22'; owner/repo#N is fine)",
    r"\bthe issue(?:'s)?\b": "a tracker issue ('the issue's target')",
    r"\bsessions?\b(?<!scope=\"session)": "a work period ('sixth session')",
    r"\bsandbox": "the build machinery",
    r"\bdevtools\b": "a tool folder outside the repository",
    r"shared/docs": "notes outside the repository",
    r"\bseed[- ]notes\b": "notes outside the repository",
    r"\bnot shipped\b": "files the user cannot see",
    r"\bnot part of (?:the|this) repository\b": "files the user cannot see",
    r"\bdevice (?:tool|session|time|notes)\b": "the machinery that lends machines",
    r"\b(?:the|a|this) (?:GPU|H200|CI|device) machine\b": "a machine of the build machinery",
    r"\bnvidia-h200": "a machine kind's name",
    r"\blent\b": "how machines were had",
    r"\bcarried to\b": "how packages reached a machine",
    r"\btime box": "the build machinery's limits",
    r"\bCEO\b": "the organisation that builds it",
    r"\bagents?\b": "who builds it",
    r"\bworktrees?\b": "how it is checked out",
    r"(?<![\w])(?<!test )(?<!host )helpers?\b(?! (?:functions?|modules?)\b)":
        "'helper' as a person",
    r"\b(?:Claude|Anthropic|ChatGPT|Copilot)\b": "a tool's name",
    r"\bbranch [`'\"]": "a branch name",
    r"probe-cluster-bwd|wt-docs|/work/": "a branch or a checkout path",
    r"--(?:extra-)?index-url\b": "a package registry's address",
}
COMPILED = [(re.compile(p, re.IGNORECASE), why) for p, why in PATTERNS.items()]


def tracked_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    return [ROOT / n for n in names if n != "tests/repo/test_wording.py" and (ROOT / n).is_file()]


def hits(text: str) -> list[tuple[int, str, str]]:
    """``(line number, the matched words, why)`` for every pattern hit in ``text``."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for rx, why in COMPILED:
            for m in rx.finditer(line):
                found.append((n, m.group(0), why))
    return found


@pytest.mark.parametrize("text, expected", [
    ("well within issue 15's 2%", "issue 15"),
    ("(issue #22)", "#22"),
    ("Sixth session, with that change", "session"),
    ("a helper wrote this", "helper"),
    ("the probe's branch `probe-cluster-bwd`", "branch `"),
    ("see shared/docs/architecture.md", "shared/docs"),
    ("on the GPU machine", "the GPU machine"),
])
def test_patterns_catch(text, expected):
    assert any(expected.lower() in words.lower() for _, words, _ in hits(text)), hits(text)


@pytest.mark.parametrize("text", [
    "the consumer issues a wgmma", "pytorch/pytorch#188390", '@pytest.fixture(scope="session")',
    "import cutlass.utils.hopper_helpers as sm90_helpers", "Shared test helpers",
    "one host helper turns indices", "the branch cost more than the multiplies",
    "a 2-core CPU machine", "H200, torch 2.11.0+cu130, 2026-12-01",
])
def test_patterns_spare(text):
    assert hits(text) == []


def test_tracked_files_have_no_telltale_words():
    found = []
    for path in tracked_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        name = path.relative_to(ROOT)
        found += [f"{name}:{n}: {words!r} ({why})" for n, words, why in hits(text)]
    assert not found, "\n".join(found)
