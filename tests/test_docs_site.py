"""The documentation site as a reader sees it: docstring examples render as code blocks.

Builds the site once (``mkdocs build --strict``, about two seconds) into a temporary folder and
reads the generated HTML. A docstring section titled ``Example:`` rather than ``Examples:`` is
read by griffe as an admonition: its ``>>>`` lines become nested Markdown quotes
(``<blockquote>``), the prompts disappear, and each example runs together with its output in
one paragraph. These tests fail on that, and on any other way an example can end up as running
text:

- every ``>>>`` on the site is the prompt of a highlighted code block (``<span class="gp">``
  inside ``<pre>``) or inline code that mentions it (``<code>`` in running text);
- an API page has no ``<blockquote>``, and no statement of its module's docstring examples
  appears in running text (outside ``<pre>``/``<code>``);
- every API page whose module has docstring examples shows them highlighted, with their output.

Skipped when the documentation tools (the ``docs`` extra) are not installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
pytest.importorskip(
    "mkdocstrings_handlers.python",
    reason="mkdocstrings-python is not installed (pip install -e '.[docs]')",
)

ROOT = Path(__file__).resolve().parents[1]
PROMPT = ">>>"
VOID_TAGS = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta",
             "source", "track", "wbr"}


class _Page(HTMLParser):
    """One HTML page, read for where its ``>>>`` prompts and its running text are."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, str]] = []  # open elements: (tag, class attribute)
        self.prompts: list[tuple[tuple[str, str], ...]] = []  # elements enclosing each '>>>'
        self.prose_lines: set[str] = set()  # stripped lines of text outside <pre> and <code>
        self.blockquotes = 0
        self.feed(html)
        self.close()

    def handle_starttag(self, tag, attrs):
        if tag == "blockquote":
            self.blockquotes += 1
        if tag not in VOID_TAGS:
            self.stack.append((tag, dict(attrs).get("class") or ""))

    def handle_endtag(self, tag):
        # Close up to the matching open element (tolerates elements left unclosed).
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                return

    def handle_data(self, data):
        enclosing = tuple(self.stack)
        self.prompts.extend([enclosing] * data.count(PROMPT))
        tags = {tag for tag, _ in enclosing}
        if not tags & {"pre", "code", "script", "style"}:
            self.prose_lines.update(line.strip() for line in data.splitlines() if line.strip())

    @staticmethod
    def is_highlighted(enclosing: tuple[tuple[str, str], ...]) -> bool:
        tags = [tag for tag, _ in enclosing]
        return (
            "pre" in tags
            and "blockquote" not in tags
            and enclosing[-1][0] == "span"
            and "gp" in enclosing[-1][1].split()
        )

    @classmethod
    def is_code(cls, enclosing: tuple[tuple[str, str], ...]) -> bool:
        """A highlighted prompt, or inline code in running text (not in a quote)."""
        tags = [tag for tag, _ in enclosing]
        inline = "code" in tags and "pre" not in tags and "blockquote" not in tags
        return inline or cls.is_highlighted(enclosing)

    def highlighted_prompts(self) -> int:
        return sum(self.is_highlighted(enclosing) for enclosing in self.prompts)


def _where(enclosing: tuple[tuple[str, str], ...]) -> str:
    return " > ".join(f"{tag}.{cls}" if cls else tag for tag, cls in enclosing[-6:]) or "(top)"


def _example_statements(module: str) -> set[str]:
    """The ``>>>`` statements in the source of ``module`` (a file or a package)."""
    path = ROOT.joinpath(*module.split("."))
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    statements = set()
    for file in files:
        text = file.read_text(encoding="utf-8")
        statements.update(s.strip() for s in re.findall(r"^\s*>>> (.+)$", text, re.M))
    return statements


def _api_pages() -> list[tuple[str, str]]:
    """(page name, documented module) for every ``::: module`` in docs/api/*.md."""
    pages = []
    for md in sorted((ROOT / "docs" / "api").glob("*.md")):
        for module in re.findall(r"^:::\s*([\w.]+)", md.read_text(encoding="utf-8"), re.M):
            pages.append((md.stem, module))
    return pages


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site_dir = tmp_path_factory.mktemp("site")
    # Not --quiet: it hides the warnings that --strict turns into a failure.
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}"
    return site_dir


def test_every_prompt_on_the_site_is_code(site):
    pages = sorted(site.rglob("*.html"))
    assert pages, "the build wrote no HTML"
    bad = []
    for path in pages:
        page = _Page(path.read_text(encoding="utf-8"))
        bad += [f"{path.relative_to(site)}: '>>>' in {_where(enclosing)}"
                for enclosing in page.prompts if not page.is_code(enclosing)]
    assert not bad, "'>>>' outside code (or unhighlighted):\n" + "\n".join(bad[:20])


def test_api_pages_show_their_examples_as_code(site):
    api_pages = _api_pages()
    assert api_pages, "no '::: module' directive in docs/api/*.md"
    bad = []
    for name, module in api_pages:
        html = (site / "api" / name / "index.html").read_text(encoding="utf-8")
        page = _Page(html)
        if page.blockquotes:
            bad.append(f"api/{name}: {page.blockquotes} <blockquote> (an 'Example:' section?)")
        statements = _example_statements(module)
        as_prose = sorted(statements & page.prose_lines)
        if as_prose:
            bad.append(f"api/{name}: examples rendered as running text: {as_prose[:5]}")
        if statements and not page.highlighted_prompts():
            bad.append(f"api/{name}: {module} has docstring examples but none renders as code")
        elif statements and '<span class="go">' not in html:
            bad.append(f"api/{name}: the examples' output is not rendered with them")
    assert not bad, (
        "docstring examples not rendered as code blocks (docstrings should title the section "
        "'Examples:'):\n" + "\n".join(bad)
    )
