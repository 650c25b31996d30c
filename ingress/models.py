"""The models an ingress serves: their cards, the ones `/v1/models` lists (those with a live
engine in the registry), and the model a request is for."""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

from tokenway.errors import check_model
from tokenway.registry import EngineRegistry
from tokenway.served import ServedModel


class ModelCard(msgspec.Struct, kw_only=True):
    """A model as OpenAI's models API and vLLM's describe it."""

    id: str
    created: int
    root: str
    max_model_len: int
    object: str = "model"
    owned_by: str = "tokenway"


class Catalog:
    def __init__(self, models: Sequence[ServedModel], registry: EngineRegistry) -> None:
        created = int(time.time())
        self.cards = {
            m.name: ModelCard(
                id=m.name,
                created=created,
                root=str(m.info.path),
                max_model_len=m.info.context_length,
            )
            for m in models
        }
        self.default = models[0].name  # of a request that names none, as in vLLM
        self.registry = registry

    def resolve(self, asked: str | None) -> str:
        """The served model a request is for; ModelNotFound (a 404) for any other."""
        check_model(asked, *self.cards)
        return self.default if asked is None else asked

    def listed(self) -> list[ModelCard]:
        """The served models an engine serves now, in the order they were given."""
        live = {engine.model for engine in self.registry.alive()}
        return [card for name, card in self.cards.items() if name in live]
