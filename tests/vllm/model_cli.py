"""What the tier's model builders share (make_qwen_model.py, make_gptoss_model.py,
make_tiny_model.py, each run as a script with the vLLM venv's python): a directory built
beside its place and renamed into it, and its JSON files; the first two, their command line

    --models-dir DIR   build `<name>-<package version>-<hash of the builder>` under DIR once,
                       and print it;
    --check DIR        hold DIR's tokenizer to the package's encoding: its problems and exit
                       1, or one line and exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def model_dir(models_dir: Path, name: str, version: str, builder: str) -> Path:
    """The directory for this package version and this builder (its file's hash)."""
    digest = hashlib.sha256(Path(builder).read_bytes()).hexdigest()[:12]
    return models_dir / f"{name}-{version}-{digest}"


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A directory beside `out` to build it in, renamed into place once the block ends
    without an error (no process ever sees a partial one); removed otherwise."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(directory: Path, docs: dict[str, Any]) -> None:
    """Each document as `directory/<name>`, indented JSON."""
    for name, doc in docs.items():
        (directory / name).write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")


def main(
    doc: str,
    name: str,
    builder: str,
    package: Callable[[], tuple[str, Any]],
    build: Callable[[Path, Any], Path],
    check: Callable[[Path, Any], list[str]],
) -> None:
    """`package()` gives the package's version and encoding (or exits); `build` writes the
    directory; `check` lists a directory's disagreements with the encoding."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--models-dir", type=Path, help="build under it; print the directory")
    group.add_argument("--check", type=Path, metavar="DIR", help="check DIR's tokenizer")
    args = p.parse_args()
    version, encoding = package()
    if args.check is not None:
        problems = check(args.check, encoding)
        print("\n".join(problems) or f"{args.check}: the tokenizer encodes as the package does")
        raise SystemExit(1 if problems else 0)
    out = model_dir(args.models_dir, name, version, builder)
    if not (out / "tokenizer.json").is_file():
        build(out, encoding)
    print(out)
