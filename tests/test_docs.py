"""The docs stay true to the repository: the checked-in rule graph is the one `make dag` writes,
relative links in the markdown docs point to files that exist, and no tracked file (docs, code,
tests) cites anything that is not in the repository (notes outside it, a design document, an
issue tracker by number rather than by URL)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    "README.md",
    "BENCHMARKS.md",
    "profiles/README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
]
# Every tracked text file is checked, code and tests included (this file's own patterns do not
# match themselves); an upstream issue is cited by its URL.
FORBIDDEN = re.compile(
    r"\.\./shared|DESIGN\.md|\breference/|\b(?:issue|pull request|PR)\s+#?\d+", re.IGNORECASE
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_dag_is_current(tmp_path):
    """docs/dag.mmd is what `make dag` writes now (the same recipe, into a temporary file)."""
    venv = Path(sys.prefix)
    out = tmp_path / "dag.mmd"
    run = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-o",
            f"{venv}/.installed",
            "dag",
            f"VENV={venv}",
            f"DAG_FILE={out}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert out.read_text() == (ROOT / "docs/dag.mmd").read_text(), (
        "docs/dag.mmd is stale: run make dag"
    )


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", re.sub(r"```.*?```", "", markdown, flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    text = (ROOT / doc).read_text()
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        file = (ROOT / doc).parent.joinpath(path) if path else ROOT / doc
        if (
            not file.exists()
            or anchor
            and file.suffix == ".md"
            and anchor not in anchors(file.read_text())
        ):
            broken.append(target)
    assert not broken, f"{doc}: links to missing files or headings: {broken}"


def test_no_references_outside_the_repository():
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    hits = []
    for name in files:
        try:
            text = (ROOT / name).read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{name}:{number}: {line.strip()}")
    assert not hits, "references to things outside the repository:\n" + "\n".join(hits)


def test_every_test_file_that_can_skip_is_in_the_skip_table():
    """docs/operations.md's Tests section names each test file holding a skip, so the README's
    "any other check only where the machine lacks what it needs" can be read off it."""
    section = (ROOT / "docs/operations.md").read_text().split("## Tests", 1)[1].split("\n## ", 1)[0]
    skipping = {
        f"tests/{path.name}"
        for path in (ROOT / "tests").glob("test_*.py")
        if re.search(r"^\s*@?pytest\.(?:skip|mark\.skip|mark\.skipif)\(", path.read_text(), re.M)
    }
    unnamed = sorted(name for name in skipping if f"`{name}`" not in section)
    assert skipping and not unnamed, (
        f"docs/operations.md's Tests section does not name {unnamed}: add each to its table"
    )
