"""The README's shape (issue 44 item 3): a newcomer sees ``make run`` and ``make test`` on its first
screen, reference material lives in docs/, and every link of the README and of docs/ leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_CHARS = 15_000
FIRST_SCREEN = 40  # lines
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def slugs(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings (``## `make test``` -> ``make-test``; a repeated one
    gets ``-1``, ``-2``...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", markdown).splitlines():
        m = re.match(r"#{1,6} +(.*?) *#*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_the_readme_is_at_most_15000_characters() -> None:
    size = len(README.read_text())
    assert size <= MAX_CHARS, f"README.md is {size:,} characters (at most {MAX_CHARS:,}): move reference to docs/"


@pytest.mark.parametrize("command", ["make run", "make test"])
def test_both_commands_are_on_the_first_screen(command: str) -> None:
    first = README.read_text().splitlines()[:FIRST_SCREEN]
    assert any(f"`{command}`" in line for line in first), f"{command} is not in README.md's first {FIRST_SCREEN} lines"


def test_the_first_screen_says_how_long_each_takes() -> None:
    first = "\n".join(README.read_text().splitlines()[:FIRST_SCREEN])
    for command in ("make run", "make test"):  # each a bullet of its own: - **`make run`** ...
        m = re.search(rf"^- \*\*`{command}`\*\*(.*?)(?=^\S|\Z)", first, re.DOTALL | re.MULTILINE)
        assert m, f"README.md's first screen has no bullet for {command}"
        assert re.search(r"\d+ minutes", m.group(1)), f"README.md's first screen does not say how long {command} takes"


@pytest.mark.parametrize("doc", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file_and_heading(doc: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https://, mailto:
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in slugs(file.read_text()):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: links that lead nowhere: {broken}"
