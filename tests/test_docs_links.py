"""Every relative link of the README and docs/ reaches a file, and every #anchor one of that page's headings.

The README's headline table points at docs/benchmarks.md's sections by anchor; a renamed heading would leave the
front page's links dead without this test.
"""

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
FENCE = re.compile(r"^(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks and indented code (links there are not links)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced and not line.startswith("    "):
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to -."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, repeats numbered as GitHub numbers them (-1, -2, ...)."""
    seen, out = Counter(), set()
    for line in prose_lines(page.read_text()):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            out.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return out


def relative_links(page: Path) -> list[str]:
    return [t for line in prose_lines(page.read_text()) for t in LINK.findall(line) if not re.match(r"\w+:", t)]


def test_slug_matches_githubs_anchors():
    """A few headings of these pages against the anchors GitHub gives them."""
    heading = "Against facebookresearch/DiT's training step, H200s"
    assert slug(heading) == "against-facebookresearchdits-training-step-h200s"
    assert slug("The 7B and 0.5B flavors") == "the-7b-and-05b-flavors"
    assert slug("FID (`scripts/evaluate_fid.py`)") == "fid-scriptsevaluate_fidpy"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)
