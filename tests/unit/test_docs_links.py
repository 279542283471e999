"""Every relative link and #anchor of the front page, CONTRIBUTING.md, BENCHMARKS.md and docs/*.md resolves.

Anchors follow GitHub's rule for headings: the heading's text (markup dropped), lowercased,
every character but letters, digits, `_`, `-` and spaces dropped, spaces turned into hyphens;
a repeated heading gets `-1`, `-2`, ... Explicit `<a id=...>`/`<a name=...>` anchors count too.
Links inside code (fenced blocks, inline code) are not links and are skipped; links with a
scheme (https:, mailto:) are not checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HTML_TARGET = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
_HTML_ANCHOR = re.compile(r"""<a\b[^>]*?\b(?:id|name)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def doc_files(repo: Path = REPO) -> list[Path]:
    return [repo / "README.md", repo / "CONTRIBUTING.md", repo / "BENCHMARKS.md",
            *sorted((repo / "docs").glob("*.md"))]


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code removed."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(_INLINE_CODE.sub("", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = "".join(ch for ch in text.lower() if ch.isalnum() or ch in "_- ")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.update(_HTML_ANCHOR.findall(line))
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    found: list[str] = []
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        matches = [*_LINK.finditer(line), *_HTML_TARGET.finditer(line)]
        found += [m.group(1) for m in sorted(matches, key=lambda m: m.start())]
        reference = _REFERENCE.match(line)
        if reference:
            found.append(reference.group(1))
    return found


def broken_links(files: list[Path], repo: Path = REPO) -> list[str]:
    """`file: target (why)` for every relative link or anchor that does not resolve."""
    broken: list[str] = []
    for path in files:
        for target in links(path):
            if not target or _SCHEME.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(repo)}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif repo.resolve() not in (dest, *dest.parents):
                broken.append(f"{where} (outside the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no such anchor in {dest.name})")
    return broken


def test_every_link_and_anchor_of_the_docs_resolves() -> None:
    files = doc_files()
    assert len(files) > 4 and all(f.exists() for f in files), files
    assert sum(len(links(f)) for f in files) > 20  # the checker sees the links at all
    broken = broken_links(files)
    assert not broken, "\n".join(broken)


def test_slugs_follow_github() -> None:
    assert slug("What the tests check, and what they do not") == "what-the-tests-check-and-what-they-do-not"
    assert slug("`rpc-observe doctor`") == "rpc-observe-doctor"
    assert slug("Where the time goes: client = callee + outside") == "where-the-time-goes-client--callee--outside"
    assert slug("`GET /debug/rpc`") == "get-debugrpc"
    assert slug("1. file_sd on a shared file system") == "1-file_sd-on-a-shared-file-system"
    assert slug("Memory over 1,000,000 RPCs (issue 13.3)") == "memory-over-1000000-rpcs-issue-133"


def test_a_broken_link_or_anchor_fails(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "# Page\n\n## Usage: `run` it\n\n## Usage: `run` it\n\n<a id=\"custom\"></a>\n", encoding="utf-8")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Top\n\n"
        "[ok](docs/page.md) [ok](docs/page.md#usage-run-it) [ok](docs/page.md#usage-run-it-1)\n"
        "[ok](#top) [ok](docs/page.md#custom) [ok](https://example.com/nowhere) ![ok](docs/)\n"
        "[gone](docs/missing.md) [bad anchor](docs/page.md#usage) [bad here](#nowhere)\n"
        "<img src=\"docs/img/missing.png\"> [outside](../elsewhere.md)\n"
        "`[code](docs/missing-in-code.md)`\n\n"
        "```\n[fenced](docs/missing-in-fence.md)\n```\n\n"
        "[ref]: docs/missing-ref.md\n", encoding="utf-8")
    (tmp_path.parent / "elsewhere.md").write_text("# x\n", encoding="utf-8")
    assert broken_links([readme, tmp_path / "docs" / "page.md"], repo=tmp_path) == [
        "README.md: docs/missing.md (no such file)",
        "README.md: docs/page.md#usage (no such anchor in page.md)",
        "README.md: #nowhere (no such anchor in README.md)",
        "README.md: docs/img/missing.png (no such file)",
        "README.md: ../elsewhere.md (outside the repository)",
        "README.md: docs/missing-ref.md (no such file)",
    ]
