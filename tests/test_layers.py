"""The house in floors, read from the imports. From the bottom:

- the ground floor, `tokenway/`: the contracts, bus table, ledger, errors, config and the ideas
  two stages share;
- the API schemas, `tokenway/api/` (OpenAI, Anthropic Messages, Responses), on the ground;
- the stages, side by side: the ingress, render, schedule, derender, batch, the dead-letter
  mover and the engines;
- the program, `program/`: the `tokenway` command, which builds the stages.

A module imports its own floor and the floors below, and a stage never a sibling: what two
stages both need lives below them."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GROUND, API, PROGRAM = "tokenway", "tokenway.api", "program"
STAGES = ("ingress", "engines", "workers.render", "workers.schedule", "workers.derender",
          "workers.batch", "workers.dlq")  # fmt: skip
# Each floor's height; the stages share one.
HEIGHT = {GROUND: 0, API: 1, **dict.fromkeys(STAGES, 2), PROGRAM: 3}


def floor(module: str) -> str | None:
    """The stage or floor a dotted module name belongs to; None outside the product."""
    for name in (*STAGES, PROGRAM, API, GROUND):  # the API package before the ground it is in
        if module == name or module.startswith(name + "."):
            return name
    return None


def product_modules() -> Iterator[tuple[str, Path]]:
    for top in ("tokenway", "ingress", "workers", "engines", "program"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, name) for every name the file imports, inside functions too: `from a.b import
    c` imports `a.b.c` (which may be a module itself)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def crossings(modules: Iterable[tuple[str, Path]]) -> list[str]:
    """Every import arrow between floors that the house forbids, with its file:line."""
    found = []
    for module, path in modules:
        here = floor(module)
        for line, name in imports(path):
            there = floor(name)
            if there is None or here is None or there == here or HEIGHT[there] < HEIGHT[here]:
                continue
            file = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name)
            found.append(f"{file}:{line}: {here} imports {name} ({there})")
    return found


def test_no_floor_imports_one_above_it_and_no_stage_imports_another() -> None:
    found = crossings(product_modules())
    assert not found, "\n".join(found)


def test_the_check_sees_an_arrow_between_stages_and_one_running_up(tmp_path: Path) -> None:
    assert floor("workers.renderer") is None
    assert floor("tokenway.wire") == GROUND
    assert floor("tokenway.api.openai") == API
    assert {m for m, _ in product_modules()} >= {"ingress.app", "engines.sim", "program.cli"}
    module = tmp_path / "probe.py"
    module.write_text("def late():\n    from workers.derender import tools\n")
    sideways = crossings([("workers.schedule.probe", module)])
    assert sideways == [
        "probe.py:2: workers.schedule imports workers.derender.tools (workers.derender)"
    ]
    assert len(crossings([("tokenway.probe", module)])) == 1  # the ground floor, running up
    assert len(crossings([("tokenway.api.probe", module)])) == 1  # the API schemas, too
    assert not crossings([("program.cli", module)])  # the program builds the stages
    module.write_text("from tokenway.api import openai\nfrom tokenway import wire\n")
    assert crossings([("tokenway.probe", module)]) == [
        "probe.py:1: tokenway imports tokenway.api.openai (tokenway.api)"
    ]
    assert not crossings([("tokenway.api.probe", module)])
    assert not crossings([("workers.derender.probe", module)])  # its own stage


def module_arrows(modules: Iterable[tuple[str, Path]]) -> dict[str, set[str]]:
    """Which of `modules` each of them imports (a name imported from a module: that module)."""
    paths = dict(modules)
    return {
        module: {n if n in paths else n.rpartition(".")[0] for _, n in imports(path)} & set(paths)
        for module, path in paths.items()
    }


def circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that reach each other through their imports (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in arrows[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            group = []
            while (n := stack.pop()) != m:
                group.append(n)
            if group:
                found.append(sorted([m, *group]))

    for m in sorted(arrows):
        if m not in index:
            visit(m)
    return found


def test_no_modules_of_the_ground_floor_import_each_other_in_a_circle() -> None:
    """The API schemas were one: protocol decoded Messages and Responses bodies by importing
    the modules that build on its own structs (issue 33)."""
    ground = [(m, p) for m, p in product_modules() if floor(m) in (GROUND, API)]
    assert circles(module_arrows(ground)) == []


def test_the_circle_check_sees_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
