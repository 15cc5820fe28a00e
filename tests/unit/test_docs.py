"""README is the front page and the manual is docs/: README stays short, every docs page is reachable from it, and
no link in README or docs/ points at a file or a heading that is not there (pages move; links must follow)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 300


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """``text`` without its fenced code blocks (a ``#`` or ``](`` inside code is neither a heading nor a link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens kept), spaces as hyphens.

        >>> slug("Generation on GPUs of its own (non-colocated)"), slug("NeMo-RL's Gym recipes")
        ('generation-on-gpus-of-its-own-non-colocated', 'nemo-rls-gym-recipes')
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def links(page: Path) -> list[str]:
    """The relative link targets of a markdown page (``[text](target)``), outside code blocks."""
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


def test_readme_is_a_front_page_of_at_most_300_lines():
    n = len((REPO / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move the manual into docs/"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(REPO / t.partition("#")[0]).resolve() for t in links(REPO / "README.md")}
    missing = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"docs pages README.md does not link (add them to its table of docs pages): {missing}"


def test_every_link_of_readme_and_docs_reaches_a_file_and_heading():
    broken = []
    for page in pages():
        for target in links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                headings = {slug(h) for h in re.findall(r"^#+ (.*)$", prose(dest.read_text()), flags=re.M)}
                if anchor not in headings:
                    broken.append(f"{page.relative_to(REPO)}: {target} (no such heading in {dest.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)
