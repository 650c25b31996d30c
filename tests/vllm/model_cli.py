"""The command line the tier's model builders share (make_qwen_model.py, make_gptoss_model.py,
each run as a script with the vLLM venv's python):

    --models-dir DIR   build `<name>-<package version>-<hash of the builder>` under DIR once,
                       and print it;
    --check DIR        hold DIR's tokenizer to the package's encoding: its problems and exit
                       1, or one line and exit 0.
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


def model_dir(models_dir: Path, name: str, version: str, builder: str) -> Path:
    """The directory for this package version and this builder (its file's hash)."""
    digest = hashlib.sha256(Path(builder).read_bytes()).hexdigest()[:12]
    return models_dir / f"{name}-{version}-{digest}"


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
