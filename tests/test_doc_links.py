"""Every relative link in README.md, docs/**/*.md and profiles/*.md points at a file or folder that exists."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "profiles").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    """The link targets of a Markdown text that name a path: no URL, no in-page anchor; without their #anchor."""
    targets = (match.group(1).split("#", 1)[0] for match in LINK.finditer(text))
    return [target for target in targets if target and not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def test_relative_links_are_told_from_urls_and_anchors():
    text = "[a](docs/x.md#part) [b](https://example.org/y.md) [c](#here) [d](mailto:x@y) [e](../profiles/runs/)"
    assert relative_links(text) == ["docs/x.md", "../profiles/runs/"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(page):
    missing = [target for target in relative_links(page.read_text()) if not (page.parent / target).exists()]
    assert not missing, f"{page.relative_to(REPO)} links to missing paths: {missing}"
