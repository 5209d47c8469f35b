"""Every relative link in README.md, deploy/README.md and docs/**/*.md points at a file (or
folder) that exists, and every #anchor at a heading of the page it names (GitHub's slugs)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "deploy" / "README.md",
                *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    return CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", page.read_text()), re.M)
    return {slug(h) for h in headings}


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text()))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: ...


def broken(page: Path) -> list[str]:
    bad = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    return bad


def test_the_pages_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/README.md", "docs/design/brief.md",
            "docs/design/architecture.md", "docs/reference/api.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    assert broken(page) == []


def test_every_docs_page_is_in_the_index():
    index = (ROOT / "docs" / "README.md").read_text()
    for page in (ROOT / "docs").rglob("*.md"):
        rel = page.relative_to(ROOT / "docs").as_posix()
        if rel != "README.md":
            assert f"]({rel})" in index, f"docs/README.md does not list {rel}"


def test_the_checker_catches_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n[ok](page.md#title) [bad](missing.md) [anchor](page.md#nope)\n"
                    "`[code](skipped.md)` [web](https://example.com)\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert broken(page) == ["page.md: missing.md (no such file)",
                                "page.md: page.md#nope (no such heading)"]
    finally:
        ROOT = saved
