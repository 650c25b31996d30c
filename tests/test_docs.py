"""The README and docs/ as a reader meets them: the README stays short and its commands are
CI's, every relative link leads to a file and heading that exist, every page is reachable
from the README, every flag of the CLI is documented somewhere, and the README's example of
each API runs against a live stack."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from program.cli import batch_parser, dlq_parser, parser
from tests.conftest import Stack

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 250
EXAMPLE_URL = "http://127.0.0.1:8000"  # `tokenway up`'s address, which the examples use

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
REPO_PATH = re.compile(
    r"(?<![\w/.-])((?:infra|examples|tests|bench|\.ci|tokenway|workers|ingress|docs)/[\w./-]*\w)"
)


def prose(text: str) -> Iterator[str]:
    """The lines of a Markdown page outside its fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without Markdown, lowercased, punctuation
    dropped, spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of `page`, a repeated heading's `-1`, `-2`... included."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in prose(page.read_text()):
        if match := HEADING.match(line):
            base = slug(match.group(2))
            count = counts.get(base, 0)
            counts[base] = count + 1
            found.add(f"{base}-{count}" if count else base)
    return found


def links(page: Path) -> Iterator[tuple[Path, str]]:
    """Each relative link of `page`: the file it names (the page itself for `#anchor`) and
    its anchor ("" for none)."""
    for line in prose(page.read_text()):
        for target in LINK.findall(re.sub(r"`[^`]*`(?!\])", "", line)):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not this repository's
            path, _, anchor = target.partition("#")
            yield (page.parent / path).resolve() if path else page, anchor


def test_the_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_every_relative_link_leads_to_a_file_and_heading_that_exist() -> None:
    broken = []
    for page in PAGES:
        for target, anchor in links(page):
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} does not exist")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: {target.name} has no #{anchor}")
    assert not broken, "\n".join(broken)


def test_every_file_the_docs_name_exists() -> None:
    """A path of this repository a page names (`infra/compose.yaml`, `tests/test_up.py`...)
    is still there: moved code takes its documentation along."""
    named = {
        (page.relative_to(ROOT), path)
        for page in PAGES
        for path in REPO_PATH.findall(page.read_text())
        if not path.startswith("infra/nats/auth")  # the operator makes it
    }
    assert named
    assert sorted((page, path) for page, path in named if not (ROOT / path).exists()) == []


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    reached, todo = {README}, [README]
    while todo:
        for target, _ in links(todo.pop()):
            if target.suffix == ".md" and target.exists() and target not in reached:
                reached.add(target)
                todo.append(target)
    assert set(PAGES) - reached == set()


def test_the_readme_installs_and_tests_as_ci_does() -> None:
    """`.ci/run` installs the test extras and runs the README's test command."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "-e '.[test]'" in ci
    (command,) = re.findall(r"^python -m pytest .*$", ci, re.M)
    sh = "\n".join(re.findall(r"```sh\n(.*?)```", README.read_text(), re.S)).splitlines()
    assert "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]'" in sh
    assert command in sh


def cli_flags() -> set[str]:
    flags: set[str] = set()
    todo = [parser(), dlq_parser(), batch_parser()]
    while todo:
        for action in todo.pop()._actions:
            flags.update(o for o in action.option_strings if o.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return flags - {"--help", "--version"}


def test_every_flag_is_documented() -> None:
    """No flag a user may need goes missing from the documentation when text moves."""
    text = "\n".join(page.read_text() for page in PAGES)
    flags = cli_flags()
    undocumented = {f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", text)}
    assert undocumented == set(), "document these flags in README.md or docs/"


def test_every_flag_a_documented_command_passes_exists() -> None:
    """A `tokenway ...` command on a page (inline or a line of a code block) passes only
    flags tokenway has: a renamed or removed flag takes its documentation along."""
    flags = cli_flags() | {"--help", "--version"}
    unknown = []
    for page in PAGES:
        text = page.read_text()
        commands = re.findall(r"`(tokenway [^`]*)`", text)
        commands += re.findall(r"^\s*(tokenway .*)$", text, re.M)
        for command in commands:
            passed = re.findall(r"(?<![\w-])--[a-z][\w-]*", command)
            unknown += [(page.name, f, command) for f in passed if f not in flags]
    assert unknown == []


def readme_examples() -> dict[str, str]:
    """The README's Python examples, by the bold label (or heading) that introduces each."""
    examples: dict[str, str] = {}
    label = ""
    fenced: list[str] | None = None
    for line in README.read_text().splitlines():
        if fenced is not None:
            if line.startswith("```"):
                examples[label] = "\n".join(fenced)
                fenced = None
            else:
                fenced.append(line)
        elif line == "```python":
            fenced = []
        elif bold := re.match(r"\*\*(.+?)\*\*", line):
            label = bold.group(1)
        elif heading := HEADING.match(line):
            label = re.sub(r"\s*\(.*", "", heading.group(2))
    return examples


EXAMPLES = readme_examples()


def test_the_readme_has_one_example_per_api() -> None:
    assert set(EXAMPLES) == {
        "Chat completions",
        "Completions",
        "OpenAI's Responses API",
        "Anthropic's Messages API",
        "The Batch API",
        "Publishing directly",
    }


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("label", sorted(EXAMPLES))
async def test_the_readme_example_runs(stack: Stack, label: str) -> None:
    """Each example as a reader runs it: its own process, against the stack where the README
    says `tokenway up`, a direct job with the env file `up` writes for the tenant's jobs."""
    code = EXAMPLES[label].replace(EXAMPLE_URL, stack.url)
    assert code != EXAMPLES[label] or "from_env" in code, "the example names no address"
    env = {**os.environ, **stack.bus.env("client-default")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, env=env, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip(), "the example printed nothing"
