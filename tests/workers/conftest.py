"""The bundled default model, materialized once per session, and the stage cores built on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tokenway.model import default_model_dir, load_model_info
from workers.derender.detok import Detokenizer
from workers.render.core import Renderer

MODEL_NAME = "deepseek-v4"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return default_model_dir(tmp_path_factory.mktemp("model-data"))


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def detok(tokenizer: Tokenizer) -> Detokenizer:
    return Detokenizer(tokenizer)


@pytest.fixture(scope="session")
def renderer(model_dir: Path) -> Renderer:
    return Renderer(load_model_info(model_dir), MODEL_NAME)
