"""The README stays a short front door and the docs stay connected (pure file reads).

- README.md is at most 250 lines and holds no run log: a run's numbers go to ``docs/results/``
  and a release's to ``CHANGELOG.md``.
- Every relative link in README.md, CHANGELOG.md and ``docs/`` points to a file that exists.
- Every results page says when, on which commit and on which host its numbers were measured,
  and links the ``benchmarks/results/`` file they come from (or names the test that writes it).
- Provenance is checked against git and the results files: every commit the docs name exists
  (one squashed away is named only beside the commit it went into), and a results page's header
  names the commit and date its results file records (``benchmarks/provenance.py``; for a file
  that records none, the commit that wrote it). A run git cannot reproduce (``+dirty``, a
  squashed commit, no results file) is accepted only on a page listed in ``RERUN_PENDING`` that
  says its figures are to be rerun.
- Every figure (N s, N %, N×, N GiB, N tokens/s ...) in ``docs/*.md`` and README.md sits in a
  paragraph or list item that links a results file or names a ``tests/test_*.py``, unless
  ``FIGURE_DEFINITIONS`` lists it as a definition or a default rather than a measurement.
"""

import functools
import json
import re
import subprocess
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


# --- Provenance: the commits and dates the pages name, against git and the results files ---

# Results pages whose figures no commit in the history reproduces, and why. Each page says so in
# its header and that its figures are "to be rerun"; the rerun at a clean, reachable commit
# (`benchmarks/provenance.py` records it) removes the entry, and an entry with nothing left to
# excuse fails.
RERUN_PENDING = {
    "async_pipeline.md": "run at 83e1ed0 with uncommitted changes (+dirty)",
    "chaos.md": "run at a24945f+dirty; a24945f was squashed into 3e991bd",
    "learning.md": "run at 83e1ed0 and 2ec7042, both with uncommitted changes (+dirty)",
    "logprob_memory.md": "run at 5533ea1+dirty; 5533ea1 was squashed into 3e991bd",
    "lora_sync.md": "run at a8a1849+dirty; a8a1849 was squashed into 3e991bd",
    "packing.md": "run at b8914a9+dirty; b8914a9 was squashed into 3e991bd",
    "prefix_cache.md": "run at 39d0786 with uncommitted changes (+dirty)",
    "real_shapes.md": "run at e305a4a with uncommitted changes (+dirty)",
    "reward_model.md": "figures printed by slow tests at 485b696 (squashed into 3e991bd), no results file",
    "rollout_throughput.md": "run at eca8342 with uncommitted changes (+dirty)",
}
PENDING_MARK = "to be rerun"
SQUASHED = re.compile(r"squashed into `([0-9a-f]{7,40})`")
HASH = re.compile(r"`([0-9a-f]{7,40})`")
RESULTS_JSON = sorted((REPO / "benchmarks" / "results").glob("*.json"))


def git(*args: str) -> str | None:
    """`git args` in the repository: its stdout, or None when git fails."""
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


needs_history = pytest.mark.skipif(
    git("rev-parse", "--is-shallow-repository") != "false",
    reason="needs a git checkout with its full history (a plain `git clone` has it)",
)


@functools.cache
def commit(rev: str) -> str | None:
    """The full sha of commit ``rev``, or None when the history holds no such commit."""
    return git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")


@functools.cache
def recorded_hashes() -> frozenset[str]:
    """Every 40-hex value the results files hold (configs' and diffs' sha1): not commits."""
    found: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            for child in node:
                walk(child)
        elif isinstance(node, str) and re.fullmatch(r"[0-9a-f]{40}", node):
            found.add(node)

    for path in RESULTS_JSON:
        walk(json.loads(path.read_text()))
    return frozenset(found)


def named_commits(text: str) -> list[str]:
    """The backticked hex strings of ``text`` that are commits: not a sha1 a results file records,
    and, when all digits (`7324573`, or a byte count), called a commit just before."""
    hashes = recorded_hashes()
    return [
        m[1]
        for m in HASH.finditer(text)
        if not any(full.startswith(m[1]) for full in hashes)
        and (not m[1].isdigit() or "commit" in text[max(0, m.start() - 40) : m.start()].lower())
    ]


def blocks(text: str) -> list[str]:
    """The prose's paragraphs, each list item and table row on its own: the unit a figure's source
    is sought in."""
    items = []
    for paragraph in re.split(r"\n\s*\n", FENCE.sub("", text)):
        items += re.split(r"\n(?=\s*(?:[-*]|\d+\.)\s|\|)", paragraph)
    return items


@needs_history
@pytest.mark.parametrize(
    "path", [README, REPO / "CHANGELOG.md", *DOCS], ids=lambda p: str(p.relative_to(REPO))
)
def test_named_commits_exist(path):
    missing = []
    for block in blocks(path.read_text()):
        into = [c for c in SQUASHED.findall(block) if commit(c)]
        missing += [c for c in named_commits(block) if not commit(c) and not into]
    assert not missing, (
        f"{path.relative_to(REPO)} names commits that are not in the history: {missing} "
        "(name a squashed commit beside the one it went into: 'squashed into `abc1234`')"
    )


def header(page: Path) -> str:
    """A results page's text before its first section: where it says when, where and on what."""
    return page.read_text().split("\n## ", 1)[0]


def recorded_runs(source: Path) -> list[tuple[str, str]]:
    """(commit, date) of every run a results file records (each dict with a ``commit``); for a file
    that records none, the commit that last wrote it and that commit's date."""
    runs = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("commit"), str):
                runs.append((node["commit"], str(node.get("date", ""))[:10]))
            node = list(node.values())
        if isinstance(node, list):
            for child in node:
                walk(child)

    walk(json.loads(source.read_text()))
    if runs:
        return runs
    wrote = git("log", "-1", "--format=%H %ad", "--date=short", "--", str(source.relative_to(REPO)))
    if not wrote:
        return []
    sha, date = wrote.split()
    return [(sha, date)]


@needs_history
@pytest.mark.parametrize("page", RESULTS, ids=lambda p: p.name)
def test_results_page_matches_its_provenance(page):
    head = header(page)
    linked = set(re.findall(r"benchmarks/results/([\w-]+)\.(?:md|json)", page.read_text()))
    sources = [REPO / "benchmarks" / "results" / f"{name}.json" for name in sorted(linked)]
    runs = [run for source in sources if source.exists() for run in recorded_runs(source)]
    on_page = {commit(c) or c for c in named_commits(head)}
    wrong, unreproducible = [], [] if runs else ["no results file records its figures"]
    for rev, date in runs:
        sha = rev.removesuffix("+dirty")
        if (commit(sha) or sha) not in on_page:
            wrong.append(f"the commit {sha} its results file records")
        if not date or date not in head:
            wrong.append(f"the date {date} its results file records")
        if rev.endswith("+dirty"):
            unreproducible.append(f"{rev}: run with uncommitted changes")
        elif not commit(sha):
            unreproducible.append(f"{sha}: not in the history")
    assert not wrong, f"docs/results/{page.name}'s header does not name {', '.join(wrong)}"
    if page.name not in RERUN_PENDING:
        assert not unreproducible, (
            f"docs/results/{page.name}: no commit reproduces its figures ({unreproducible}); "
            "rerun at a clean commit, or list it in RERUN_PENDING and say so on the page"
        )
        return
    assert unreproducible, f"docs/results/{page.name} is reproducible: remove it from RERUN_PENDING"
    assert PENDING_MARK in " ".join(head.split()), (
        f"docs/results/{page.name} is in RERUN_PENDING ({RERUN_PENDING[page.name]}) but its "
        f"header does not say its figures are {PENDING_MARK!r}"
    )


# --- Figures: every measured number in docs/*.md and README.md points to where it was measured ---

FIGURE = re.compile(
    r"(?<![\w.\-/`])~?\d[\d,]*(?:\.\d+)?(?:\s?[–-]\s?\d[\d,]*(?:\.\d+)?)?"
    r"(?:[×x]|\s?(?:k?\s?tokens/s|GiB|MiB|GB|MB|ms|min|s|%))(?![\w/])"
)
FIGURE_SOURCE = re.compile(r"results/[\w.-]+\.(?:md|json)|tests/test_\w+\.py")
# Figures that define or set something rather than measure it: (file, text of the figure's
# paragraph, why). A measurement never goes here: it links its results file or its test.
FIGURE_DEFINITIONS = [
    ("data-and-rewards.md", "defaults to 60 s", "a config default"),
    ("environments.md", "per command (10 s", "a config default"),
    ("environments.md", "per action (10 s)", "a config default"),
    ("environments.md", "(120 s) makes its samples", "a config default"),
    ("sandbox.md", "(10 s) and then tried again", "a config default"),
    ("data-and-rewards.md", "`25%`", "an answer format math-verify reads"),
    ("getting-started.md", "30% follow a broken", "how the demo's data is generated"),
    ("architecture.md", "fixed 20 ms sleep", "vLLM's constant, which trident drops"),
    ("failures.md", "waits (up to 300 s)", "the fault hook's wait, a constant"),
    ("failures.md", "(default 1800 s)", "a config default"),
    ("gpu.md", "if 150 s of the budget remain", "the trainer check's rule for its 7B case"),
    ("failures.md", "600 s for trainer ranks", "a start-up bound, a constant"),
    ("failures.md", "default is often 64 MB", "Docker's default /dev/shm size"),
    ("config.md", "(~1-2% of the bytes)", "arithmetic: r=16 adapters' share of a model's bytes"),
    ("config.md", "0.6 GB", "arithmetic: 1024 × 151,936 float32 logits"),
    ("testing.md", "a 1 MB response", "a test's input"),
    ("scaling.md", "under 400 MB of weights", "a threshold trident sets"),
    ("scaling.md", "over 32 MiB", "glibc's mmap threshold"),
]


@pytest.mark.parametrize(
    "path",
    [README, *sorted((REPO / "docs").glob("*.md"))],
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_every_figure_names_its_source(path):
    allowed = [text for name, text, _ in FIGURE_DEFINITIONS if name == path.name]
    unsourced = []
    for block in blocks(path.read_text()):
        block = " ".join(block.split())
        for text in allowed:
            block = block.replace(text, "")  # the definition's figure, not the rest of the block
        if FIGURE.search(block) and not FIGURE_SOURCE.search(block):
            unsourced.append(f"{FIGURE.findall(block)} in {block[:100]!r}")
    assert not unsourced, (
        f"{path.relative_to(REPO)} has figures that link no results file and name no test "
        "(link docs/results/ or benchmarks/results/, name the tests/test_*.py, or delete the "
        "figure; a definition or default goes in FIGURE_DEFINITIONS):\n  " + "\n  ".join(unsourced)
    )


def test_figure_definitions_are_in_the_docs():
    stale = [
        (name, text)
        for name, text, _ in FIGURE_DEFINITIONS
        if text not in " ".join((REPO / "docs" / name).read_text().split())
    ]
    assert not stale, f"FIGURE_DEFINITIONS names text the docs no longer hold: {stale}"
