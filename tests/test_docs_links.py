"""Every relative markdown link in the project's documents points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ["README.md", "CHANGELOG.md", "benchmarks/README.md",
             *(str(p.relative_to(ROOT)) for p in sorted(ROOT.glob("docs/*.md")))]
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)  # code is not prose: `a[0](b)` is no link
INLINE = r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"  # [text](target "title"), images too
REFERENCE = r"^\s*\[[^\]\n]+\]:\s*(\S+)"  # [label]: target
LINK = re.compile(f"{INLINE}|{REFERENCE}", re.MULTILINE)


def broken_links(document: Path) -> list[str]:
    """The relative link targets in `document` with no file or directory behind them."""
    text = CODE.sub("", document.read_text())
    targets = [inline or reference for inline, reference in LINK.findall(text)]
    local = [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:|#", t, re.IGNORECASE)]
    return [t for t in local if not (document.parent / t.split("#")[0].split("?")[0]).exists()]


def test_every_relative_link_resolves():
    broken = {name: broken_links(ROOT / name) for name in DOCUMENTS}
    assert {name: links for name, links in broken.items() if links} == {}


def test_a_link_to_a_missing_file_is_found(tmp_path):
    (tmp_path / "there.md").write_text("")
    (tmp_path / "doc.md").write_text(
        "[ok](there.md#a-section) [web](https://example.com) [anchor](#top) ![img](gone.png)\n"
        "[missing](docs/gone.md) `[code](not-a-link.md)`\n\n[ref]: also-gone.md\n"
        "```\n[fenced](nor-this.md)\n```\n")
    assert broken_links(tmp_path / "doc.md") == ["gone.png", "docs/gone.md", "also-gone.md"]
