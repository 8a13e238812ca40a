"""The docs a newcomer navigates: a short front page, links that lead somewhere, a reference that is current.

- docs/configuration.md's reference is what scripts/config_reference.py generates from the settings
  models now, so a new or changed setting fails here until the page is regenerated;
- every relative link in README.md and docs/*.md, and every absolute one into this repository on GitHub,
  names a file that exists, and every ``#anchor`` into a markdown file names one of its headings (GitHub's
  slugs);
- README.md is also the PyPI page: it opens with ``pip install``, its links and images are absolute (PyPI
  has no repository to resolve a relative one against), it holds the two set-up commands for
  contributors, and it stays a front page (under 250 lines).
"""

from __future__ import annotations

import difflib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
MAX_README_LINES = 250

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
#: this repository on GitHub: such a link is checked as the relative one it stands for
_OURS = re.compile(r"^https://(?:github\.com/cedana/cedana-airflow/(?:blob|tree)/main/|"
                   r"raw\.githubusercontent\.com/cedana/cedana-airflow/main/)(.*)$")
_REPO_PAGE = "https://github.com/cedana/cedana-airflow"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("config_reference", module)
    spec.loader.exec_module(module)
    return module


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks (a link or heading inside one is an example, not a link)."""
    out: list[str] = []
    fence = ""
    for line in text.splitlines():
        m = _FENCE.match(line)
        if m:
            fence = "" if fence and line.strip().startswith(fence) else (fence or m.group(1))
            continue
        if not fence:
            out.append(line)
    return out


def _fenced_blocks(text: str) -> list[list[str]]:
    blocks: list[list[str]] = []
    fence = ""
    current: list[str] = []
    for line in text.splitlines():
        m = _FENCE.match(line)
        if m and not fence:
            fence, current = m.group(1), []
        elif fence and line.strip().startswith(fence):
            blocks.append(current)
            fence = ""
        elif fence:
            current.append(line)
    return blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a markdown file offers: its headings' slugs (repeats get -1, -2, ...) and <a name/id>."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text()):
        out.update(_HTML_ANCHOR.findall(line))
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    """The link targets of a markdown file: inline links and images, and reference definitions."""
    out = []
    for line in _prose(path.read_text()):
        line = _INLINE_CODE.sub("code", line)
        out.extend(_LINK.findall(line))
        m = _REFERENCE.match(line)
        if m:
            out.append(m.group(1))
    return out


def broken_links(path: Path) -> list[str]:
    """What is wrong with each relative link of ``path``: a file that does not exist, or an unknown anchor."""
    problems = []
    for target in links(path):
        ours = _OURS.match(target)
        if not ours and re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = (ours.group(1) if ours else target).partition("#")
        base = REPO if ours else path.parent
        dest = (base / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{target}: {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: {dest.name} has no heading with the anchor #{anchor}")
    return problems


def test_the_configuration_reference_is_generated_from_the_settings_now() -> None:
    script = _script()
    have = script.current(script.PAGE.read_text())
    want = script.generated()
    assert have == want, (
        f"docs/configuration.md's reference differs from the settings models: run `{script.FIX}`\n"
        + "".join(difflib.unified_diff(have.splitlines(True), want.splitlines(True), "page", "models")))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_to_a_file_and_a_heading(page: Path) -> None:
    problems = broken_links(page)
    assert not problems, f"{page.relative_to(REPO)}: broken links:\n  " + "\n  ".join(problems)


def test_readme_opens_with_pip_install_and_holds_the_two_set_up_commands() -> None:
    blocks = _fenced_blocks(README.read_text())
    assert blocks and blocks[0][0].startswith("pip install"), (
        f"README.md is the PyPI page: its first fenced block must be the `pip install` line, not {blocks[:1]!r}")
    commands = [[line.split("#", 1)[0].strip() for line in block] for block in blocks]
    assert ["make demo", "make test"] in commands, (
        "README.md must keep a fenced block of exactly `make demo` and `make test` (comments allowed), for contributors")


def test_readme_links_and_images_are_absolute_for_pypi() -> None:
    relative = [t for t in links(README) if not re.match(r"^(https?:|mailto:|#)", t)]
    assert not relative, f"README.md is also the PyPI page, which cannot resolve relative links: {relative}"
    ours = [t for t in links(README) if t.startswith(_REPO_PAGE)]
    assert ours and all(_OURS.match(t) or t.rstrip("/") in (_REPO_PAGE, _REPO_PAGE + "#readme") for t in ours)
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)", "\n".join(_prose(README.read_text())))
    assert images and all(t.startswith("https://raw.githubusercontent.com/") for t in images), images


def test_readme_is_a_front_page() -> None:
    n = len(README.read_text().splitlines())
    assert n < MAX_README_LINES, (
        f"README.md has {n} lines (limit {MAX_README_LINES}): it is the front page; move reference to a page "
        "under docs/ and link it")


@pytest.mark.parametrize(("heading", "anchor"), [
    ("What is not exercised here", "what-is-not-exercised-here"),
    ("`make demo-slurm`", "make-demo-slurm"),
    ("The `gpu` setting: `auto` | `off` | `require`", "the-gpu-setting-auto--off--require"),
    ("Checkpoint browser (in the Airflow UI)", "checkpoint-browser-in-the-airflow-ui"),
    ("Dependencies, and why", "dependencies-and-why"),
    ("snake_case and 2026-12-01", "snake_case-and-2026-12-01"),
])
def test_slugs_follow_githubs_rules(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


#: Where each command's flags are documented (docs/cli.md points to these pages for the commands it does not describe).
_CLI_PAGES = {"explain": "opt-in.md", "drill": "drills.md", "drills": "drills.md", "agent": "agent.md",
              "slurm-job": "slurm.md", "key": "security.md"}


def test_the_cli_reference_and_the_parser_agree() -> None:
    """Every flag docs/cli.md's synopsis shows exists on its command, and every flag of every command is
    documented (docs/cli.md, or the page it points to for that command): issue 51's `--exact`, `--json`."""
    sys.path.insert(0, str(REPO))
    from cedana_airflow.cli import _parser

    [sub] = [a for a in _parser()._actions if a.dest == "verb"]
    flags = {verb: {s for a in p._actions for s in a.option_strings if s.startswith("--")} for verb, p in sub.choices.items()}
    cli_md = (REPO / "docs" / "cli.md").read_text()
    synopsis = cli_md.split("```", 2)[1]
    shown = [(m[1], flag) for m in re.finditer(r"^cedana-airflow ([\w-]+)(.*?)(?:#|$)", synopsis, re.M)
             for flag in re.findall(r"--[\w-]+", m[2].split(" -- ")[0])]  # not the workload's own flags
    assert shown, "docs/cli.md's synopsis names no flag"
    assert [f"{verb} {flag}" for verb, flag in shown if flag not in flags[verb]] == []
    undocumented = []
    for verb, options in flags.items():
        text = cli_md + ((REPO / "docs" / _CLI_PAGES[verb]).read_text() if verb in _CLI_PAGES else "")
        undocumented += [f"{verb} {flag}" for flag in sorted(options - {"--help"}) if f"`{flag}" not in text
                         and not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)]
    assert undocumented == []
