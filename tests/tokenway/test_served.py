"""Which models a process serves, from `--model NAME[=DIR]` or `--model-dir`, and the
vLLM servers that run each."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.vllm_http import vllm_urls
from program.cli import main
from tests.conftest import make_settings
from tokenway.model import DEFAULT_MODEL_NAME, default_model_dir
from tokenway.served import DEFAULT_PARSERS, parser_flags, served_models


def test_models_are_named_with_their_directories_in_the_order_given(tmp_path: Path) -> None:
    bundled = default_model_dir(tmp_path)
    a, b = served_models(make_settings(tmp_path, models=f"a, b={bundled}"))
    assert (a.name, a.bundled, b.name, b.bundled) == ("a", True, "b", False)
    assert a.info.path == b.info.path == bundled
    # the bundled tokenizer brings its parsers; a directory given, what its template speaks
    # (here the same template: DeepSeek's formats)
    assert parser_flags(make_settings(tmp_path), a) == DEFAULT_PARSERS
    assert parser_flags(make_settings(tmp_path), b) == DEFAULT_PARSERS
    (one,) = served_models(make_settings(tmp_path))
    assert (one.name, one.bundled) == (DEFAULT_MODEL_NAME, True)
    (named,) = served_models(make_settings(tmp_path, model_dir=str(bundled)))
    assert named.name == bundled.name


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"models": "a,a"}, "'a' is named twice"),
        ({"models": "a.b,a_b"}, "would share the bus's subjects"),
        ({"models": "a", "served_model_name": "x"}, "not both"),
        ({"models": "=dir"}, "NAME=DIR"),
        ({"models": "a,b", "render_backend": "vllm"}, "one render process per model"),
        ({"models": "a,b", "derender_backend": "vllm"}, "one derender process per model"),
        ({"models": "a=/nowhere"}, "does not exist"),
    ],
)
def test_models_that_cannot_be_served_refuse_to_start(
    tmp_path: Path, overrides: dict[str, str], reason: str
) -> None:
    with pytest.raises(SystemExit, match=reason):
        served_models(make_settings(tmp_path, **overrides))


def test_vllm_urls_name_their_model_where_several_are_served() -> None:
    assert vllm_urls("http://h:1/", ["a"]) == [("a", "http://h:1")]
    assert vllm_urls("b=http://h:2,a=http://h:1?x=1", ["a", "b"]) == [
        ("b", "http://h:2"), ("a", "http://h:1?x=1")
    ]  # fmt: skip
    with pytest.raises(ValueError, match="name the one of http://h:1 as MODEL=http://h:1"):
        vllm_urls("http://h:1", ["a", "b"])
    with pytest.raises(ValueError, match="'c' is not a served model"):
        vllm_urls("c=http://h:1", ["a", "b"])


def test_the_model_flag_repeats(tmp_path: Path) -> None:
    """`--model` given twice reaches the settings as both (`up --help` would not tell)."""
    with pytest.raises(SystemExit, match="'a' is named twice"):
        main(["render", "--nats", "nats://127.0.0.1:1", "--data-dir", str(tmp_path),
              "--model", "a", "--model", "a"])  # fmt: skip
