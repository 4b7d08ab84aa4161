"""The documentation names only what exists: every ``amp8/...`` path and every dotted
``amp8.x.y`` name in DESIGN.md, README.md and docs/*.md, and every link from one page
to another file of the repository."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from conftest import ROOT

PAGES = sorted([ROOT / "DESIGN.md", ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
"""The pages a reader trusts to describe the code as it is."""

PATH = re.compile(r"(?<![\w/.-])amp8/[\w/.-]*")
"""A path in the package: ``amp8/tensor/stored.py``, ``amp8/nn/``."""

DOTTED = re.compile(r"(?<![\w/.-])amp8(?:\.[A-Za-z_]\w*)+")
"""A dotted name under the package: ``amp8.quant.codec.Layout``, ``amp8.initialize``."""

LINK = re.compile(r"\]\(([^)\s]+)\)")
"""The target of a markdown link."""


def _named(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    """Each (page, match) of ``pattern`` in the pages, once per page."""
    found = {(page.relative_to(ROOT).as_posix(), match.group(0).rstrip(".,:;"))
             for page in PAGES for match in pattern.finditer(page.read_text())}
    return sorted(found)


def test_the_pages_are_found() -> None:
    assert {"DESIGN.md", "README.md"} <= {page.name for page in PAGES} and len(PAGES) > 3


@pytest.mark.parametrize(("page", "path"), _named(PATH))
def test_a_named_path_exists(page: str, path: str) -> None:
    assert (ROOT / path).exists(), f"{page} names {path}, which does not exist"


def _missing_part(name: str) -> str | None:
    """The first part of the dotted ``name`` that is neither a module of amp8 nor an
    attribute of the module before it, or None where every part resolves. Past the
    first attribute nothing is checked: it may be an instance's attribute."""
    parts = name.split(".")
    module = importlib.import_module(parts[0])
    for index in range(1, len(parts)):
        prefix = ".".join(parts[: index + 1])
        if hasattr(module, "__path__") and importlib.util.find_spec(prefix) is not None:
            try:
                module = importlib.import_module(prefix)
            except ModuleNotFoundError as error:  # the module is there; a library it needs is not
                if (error.name or "amp8").split(".")[0] == "amp8":
                    raise
                return None
            continue
        return None if hasattr(module, parts[index]) else prefix
    return None


@pytest.mark.parametrize(("page", "name"), _named(DOTTED))
def test_a_named_module_or_name_exists(page: str, name: str) -> None:
    missing = _missing_part(name)
    assert missing is None, f"{page} names {name}: {missing} does not exist"


def _links() -> list[tuple[str, str]]:
    """Each (page, target) of a link to a file of the repository, with its anchor."""
    return sorted({(page.relative_to(ROOT).as_posix(), target)
                   for page in PAGES for target in LINK.findall(page.read_text())
                   if not re.match(r"[a-z]+:", target)})


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``page`` (a ``#`` line inside a fenced
    code block is a comment, not a heading)."""
    prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    headings = re.findall(r"^#+ (.+)$", prose, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize(("page", "target"), _links())
def test_a_link_reaches_its_file_and_heading(page: str, target: str) -> None:
    path, _, anchor = target.partition("#")
    linked = (ROOT / page).parent / path if path else ROOT / page
    assert linked.exists(), f"{page} links to {target}: no such file"
    if anchor and linked.suffix == ".md":
        assert anchor in _anchors(linked), f"{page} links to {target}: no such heading"
