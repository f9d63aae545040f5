"""The docs hold together: every link and `docs/<page>.md` mention resolves; no docs page is over 800 lines."""

from __future__ import annotations

import re
from collections import Counter
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_DOC_LINES = 800
# The project's own code and build files that name docs pages (not .venv*, build/ or vendored copies).
CODE_FOLDERS = ("compiler", "runtime", "vllm_backend", "adapters", "testing", "benchmarks", "tests", "examples")

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# A docs page named in prose or code: docs/NAME.md, docs/NAME.md#ANCHOR, or docs/NAME.md, "Section" ('Section').
MENTION = re.compile(r"docs/([A-Za-z0-9_./-]+?\.md)(#[A-Za-z0-9_-]+)?(?:, (?:\"([^\"\n]+)\"|'([^'\n]+)'))?")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def code_files() -> list[Path]:
    files = [ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / ".ci" / "run"]
    files += sorted((ROOT / "requirements").glob("*.txt"))
    for folder in CODE_FOLDERS:
        files += sorted(path for path in (ROOT / folder).rglob("*.py") if "__pycache__" not in path.parts)
    return [path for path in files if path.is_file() and path != Path(__file__).resolve()]  # this file names no page


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def without_code(text: str) -> str:
    return INLINE_CODE.sub("", FENCE.sub("", text))


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every heading anchor of a markdown file, duplicates numbered -1, -2 as GitHub numbers them."""
    seen: Counter[str] = Counter()
    found = set()
    for match in HEADING.finditer(FENCE.sub("", path.read_text())):
        base = slug(match.group(1))
        found.add(f"{base}-{seen[base]}" if seen[base] else base)
        seen[base] += 1
    return frozenset(found)


@cache
def section_titles(path: Path) -> tuple[str, ...]:
    """What prose may quote as a section of a page: its headings and its paragraphs' bold leads, markup dropped."""
    text = FENCE.sub("", path.read_text())
    titles = [match.group(1) for match in HEADING.finditer(text)] + re.findall(r"^\*\*([^*\n]+)\*\*", text, re.M)
    return tuple(title.replace("`", "") for title in titles)


def problem(target: Path, anchor: str, quoted: str | None = None) -> str | None:
    """What is wrong with a reference to `target#anchor` (or to a section quoted by name), or None."""
    if not target.is_file():
        return f"{target.relative_to(ROOT) if target.is_relative_to(ROOT) else target} does not exist"
    if anchor and target.suffix == ".md" and anchor not in anchors(target):
        return f"{target.relative_to(ROOT)} has no heading #{anchor}"
    if quoted and not any(title.lower().startswith(quoted.lower()) for title in section_titles(target)):
        return f"{target.relative_to(ROOT)} has no section \"{quoted}\""
    return None


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def test_slug_follows_githubs_rule():
    assert slug("Strided runs: cost in stored runs, not rows") == "strided-runs-cost-in-stored-runs-not-rows"
    assert slug("The bounded ring (`ring_bytes`)") == "the-bounded-ring-ring_bytes"
    assert slug("Delta syncs (`make bench-delta`, issue 29)") == "delta-syncs-make-bench-delta-issue-29"
    assert slug("Host independence (`vllm_patches.py`)") == "host-independence-vllm_patchespy"


def test_every_markdown_link_resolves():
    broken = []
    for doc in markdown_files():
        text = doc.read_text()
        for match in LINK.finditer(without_code(text)):
            href = match.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", href):  # https:, mailto: ...
                continue
            file_part, _, anchor = href.partition("#")
            target = (doc.parent / file_part).resolve() if file_part else doc
            label = re.match(r"!?\[([^\]\n]*)\]", match.group(0)).group(1)
            if re.fullmatch(r"(docs/)?[\w.-]+\.md", label) and file_part and Path(label).name != Path(file_part).name:
                broken.append(f"{doc.relative_to(ROOT)}: link [{label}]({href}) names another page than it opens")
            elif why := problem(target, anchor):
                broken.append(f"{doc.relative_to(ROOT)}: link ({href}): {why}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_page_named_in_prose_or_code_exists():
    broken = []
    for path in markdown_files() + code_files():
        text = path.read_text()
        for match in MENTION.finditer(text):
            name, anchor, quoted = match.group(1), (match.group(2) or "#")[1:], match.group(3) or match.group(4)
            if why := problem(ROOT / "docs" / name, anchor, quoted):
                broken.append(f"{path.relative_to(ROOT)}:{line_of(text, match.start())}: {match.group(0)}: {why}")
    assert not broken, "docs references that do not resolve:\n" + "\n".join(broken)


def test_no_doc_is_longer_than_800_lines():
    long = [f"{doc.relative_to(ROOT)}: {n} lines" for doc in markdown_files()[1:]
            if (n := len(doc.read_text().splitlines())) > MAX_DOC_LINES]
    assert not long, f"split these by reader or topic (at most {MAX_DOC_LINES} lines each): {long}"
