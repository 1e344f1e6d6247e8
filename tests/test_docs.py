"""The README stays a short front door and the docs stay connected (pure file reads).

- README.md is at most 250 lines and holds no run log: a run's numbers go to ``docs/results/``
  and a release's to ``CHANGELOG.md``.
- Every relative link in README.md, CHANGELOG.md and ``docs/`` points to a file that exists.
- Every results page says when, on which commit and on which host its numbers were measured,
  and links the ``benchmarks/results/`` file they come from (or names the test that writes it).
"""

import re
from pathlib import Path

import pytest

from tests.conftest import REPO

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").rglob("*.md"))
RESULTS = sorted((REPO / "docs" / "results").glob("*.md"))

RUN_LOG = [
    "this release",
    "the release before",
    "previous release",
    "fresh clone",
    "this session",
    "this host",
    "this run",
    "on an avx",
]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def prose(path: Path) -> str:
    """The file's text without its fenced code blocks (commands and output, not links)."""
    return FENCE.sub("", path.read_text())


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250): move it to docs/"


def test_readme_holds_no_run_log():
    text = README.read_text().lower()
    found = [phrase for phrase in RUN_LOG if phrase in text]
    assert not found, (
        f"README.md reads like a run log ({found}): a run's numbers go to docs/results/, "
        "a release's to CHANGELOG.md"
    )


@pytest.mark.parametrize(
    "path", [README, REPO / "CHANGELOG.md", *DOCS], ids=lambda p: str(p.relative_to(REPO))
)
def test_relative_links_resolve(path):
    missing = []
    for target in LINK.findall(prose(path)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor on the same page
        if not (path.parent / target.split("#", 1)[0]).exists():
            missing.append(target)
    assert not missing, f"{path.relative_to(REPO)} links to files that do not exist: {missing}"


@pytest.mark.parametrize("page", RESULTS, ids=lambda p: p.name)
def test_results_page_names_its_source(page):
    text = page.read_text()
    lacks = [
        what
        for what, pattern in [
            ("a date (YYYY-MM-DD)", r"\b20\d\d-\d\d-\d\d\b"),
            ("a commit (`abc1234`)", r"(?i)commit\w*\b[^\n]{0,40}?`[0-9a-f]{7,40}"),
            ("a host", r"(?i)\bhost\b"),
            (
                "its source (a benchmarks/results/ link or the test that writes it)",
                r"\]\((\.\./)+benchmarks/results/[\w.-]+\)|`tests/test_\w+\.py",
            ),
        ]
        if not re.search(pattern, text)
    ]
    assert not lacks, f"docs/results/{page.name} does not name {', '.join(lacks)}"


def test_every_results_file_has_a_page():
    pages = "\n".join(p.read_text() for p in RESULTS)
    unlinked = [
        f.name
        for f in sorted((REPO / "benchmarks" / "results").glob("*.json"))
        if f"benchmarks/results/{f.stem}." not in pages
    ]
    assert not unlinked, f"no page in docs/results/ links {unlinked}"
