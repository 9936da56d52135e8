"""The documentation holds together: README.md's and docs/'s links lead somewhere, every page is
in the site's nav, the README stays a short front door with its two commands, and no comment or
doc cites what a reader of the repository cannot open (a workspace file, an issue number, a
review's finding id). `mkdocs build --strict` (scripts/lint) checks the site itself; these run
without mkdocs."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# [text](target) and ![alt](target); a target has no spaces (an optional "title" may follow).
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def slug(heading: str) -> str:
    """The anchor GitHub and MkDocs' toc give a heading: lower case, punctuation dropped,
    spaces as hyphens."""
    text = re.sub(r"`|\*\*?|__?", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    text = _FENCE.sub("", md.read_text(encoding="utf-8"))
    return {slug(h) for h in _HEADING.findall(text)}


def dead_links(md: Path) -> list[str]:
    """Each link of ``md`` to a file of this repository that does not exist, or to a heading that
    its target does not have: ``"target (why)"``."""
    text = _FENCE.sub("", md.read_text(encoding="utf-8"))
    dead = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            dead.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            dead.append(f"{target} (no such heading)")
    return dead


def test_readme_links_lead_somewhere() -> None:
    assert dead_links(README) == []


@pytest.mark.parametrize("page", sorted(DOCS.rglob("*.md")), ids=lambda p: str(p.relative_to(DOCS)))
def test_docs_links_lead_somewhere(page: Path) -> None:
    assert dead_links(page) == []


def test_the_link_check_finds_dead_links_and_missing_headings(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A `code` heading, with punctuation\n\ntext\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-code-heading-with-punctuation) [web](https://example.org/x)\n"
        "[gone](missing.md) [no heading](there.md#nope) ![img](missing.png) [self](#page)\n\n"
        "```\n[in a code block](ignored.md)\n```\n# Page\n"
    )
    assert dead_links(page) == [
        "missing.md (no such file)",
        "there.md#nope (no such heading)",
        "missing.png (no such file)",
    ]


def _nav_pages(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in _nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_pages(value)]
    return []


def test_every_page_is_in_the_sites_nav_and_every_nav_entry_exists() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages
    assert config["strict"] is True


def test_readme_is_a_short_front_door_with_its_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 220, "README.md is the front door: the rest belongs in docs/"
    for command in ("./scripts/demo", "./scripts/test"):
        assert f"`{command}`" in text
        assert os.access(ROOT / command, os.X_OK)
    assert "./scripts/test" in (ROOT / ".ci" / "run").read_text()


# What a reader of the repository cannot open: the project's workspace beside the checkout,
# issue numbers, work sessions, and the finding ids of reviews that live outside the repo.
# Cite docs/ (docs/design/security.md for the security model) or the code instead.
UNREACHABLE = {
    "a workspace path": re.compile(r"\.\./shared\b|\bshared/(?:design|reference)/"),
    "the workspace's architecture sketch": re.compile(r"ARCHITECTURE\.md"),
    "a review": re.compile(r"\b(?:security|design) review\b", re.I),
    "an issue number": re.compile(r"\bissues? #?\d+", re.I),
    "a work session": re.compile(r"\bsession \d+\b", re.I),
    "a section sign": re.compile(r"§\s*\d"),
    "a finding id": re.compile(r"\breview [CHMLS]\d|(?<![\w-])[CHMLS][1-9]b?(?=[),/:])|\bR\d-[A-Z]\d"),
}
_TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".j2", ".txt", ".cfg", ".mako", ".html", ".js", ".css"}
_SKIP_DIRS = {"__pycache__", "golden", "data", "results"}
_ROOTS = [
    "detslurm",
    "cli",
    "launchers",
    "templates",
    "tests",
    "scripts",
    "bench",
    "examples",
    "docs",
    "site-configs",
    ".ci",
]
_ROOT_FILES = ["README.md", "pyproject.toml", "setup.py", "mkdocs.yml", "constraints.txt"]


def _repo_text_files() -> list[Path]:
    files = [ROOT / name for name in _ROOT_FILES if (ROOT / name).exists()]
    for top in _ROOTS:
        for dirpath, dirnames, filenames in os.walk(ROOT / top):
            dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
            for name in filenames:
                path = Path(dirpath) / name
                # Extensionless files in scripts/, .ci/ and bench/ are shell scripts.
                if path.suffix in _TEXT_SUFFIXES or (not path.suffix and top in ("scripts", ".ci", "bench")):
                    files.append(path)
    return [f for f in files if f != Path(__file__).resolve()]


def unreachable_references(text: str) -> list[str]:
    """``"line N: what: the text"`` for each reference in ``text`` a reader cannot follow."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in UNREACHABLE.items():
            if pattern.search(line):
                found.append(f"line {number}: {what}: {line.strip()[:100]}")
    return found


def test_no_comment_or_doc_cites_what_a_reader_cannot_open() -> None:
    problems = []
    for path in _repo_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        problems += [f"{path.relative_to(ROOT)} {p}" for p in unreachable_references(text)]
    assert problems == []


_DOCS_PATH = re.compile(r"\bdocs/[\w./-]+?\.(?:md|png)\b")


def test_every_docs_page_the_code_names_exists() -> None:
    """Comments, messages and pages that name a page by path (``docs/design/security.md``) name
    one that exists: a page moved or renamed takes its citations along."""
    missing = []
    for path in _repo_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for name in set(_DOCS_PATH.findall(text)):
            if not (ROOT / name).is_file():
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert missing == []


@pytest.mark.parametrize(
    "line",
    [
        "See `../shared/design/ARCHITECTURE.md` for the contracts.",
        "# The run's secret (security review C1): normally",
        "after validation (review L2/C3): a variable",
        "the whole tick: H1):",
        "(issue 15 item 2)",
        "measured in session 6",
        "Determined's lifecycle rules, reference §6",
        "### R3-M1 remote download",
    ],
)
def test_the_reference_check_catches(line: str) -> None:
    assert unreachable_references(line)


@pytest.mark.parametrize(
    "line",
    [
        "cleaned of C0 and C1 controls (U+009B is a one-character CSI)",
        "nodes c1 c2 (2 CPUs each) and g1 g2",
        "host_path: /shared/datasets",
        "the design (docs/design/security.md)",
        "an H100 and an H200",
    ],
)
def test_the_reference_check_leaves_ordinary_text_alone(line: str) -> None:
    assert unreachable_references(line) == []
