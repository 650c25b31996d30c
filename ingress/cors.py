"""Cross-origin requests from browsers: off unless `--allowed-origins` names who may.

Off by default where vLLM allows every origin: a tokenway on a laptop or an open internal
network would otherwise answer any web page its user visits, with whatever the browser
holds for it. Preflights are answered before API keys are asked for (browsers send none).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

from ingress.completions import REQUEST_ID_HEADER, STREAM_ID_HEADER
from tokenway.config import Settings

# What a browser script may read of a response besides the CORS-safe headers.
EXPOSED = [REQUEST_ID_HEADER.decode(), STREAM_ID_HEADER.decode(), "retry-after"]


def names(value: str) -> list[str]:
    """A list setting as vLLM takes it (a JSON list) or as a comma-separated string."""
    if not value.lstrip().startswith("["):
        return [v.strip() for v in value.split(",") if v.strip()]
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{value!r} is not a JSON list: {exc}") from None
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise ValueError(f"{value!r} must be a list of strings")
    return [v.strip() for v in parsed if v.strip()]


@dataclass(frozen=True)
class Cors:
    origins: list[str]
    methods: list[str]
    headers: list[str]
    credentials: bool

    @classmethod
    def load(cls, settings: Settings) -> Cors | None:
        """The policy the settings ask for; None when they allow no origin. ValueError
        for one no browser should be given."""
        origins = names(settings.allowed_origins)
        if not origins:
            return None
        if settings.allow_credentials and "*" in origins:
            raise ValueError(
                "--allow-credentials with --allowed-origins '*' lets every web site send "
                "requests with its visitors' credentials; name the origins instead"
            )
        return cls(
            origins,
            names(settings.allowed_methods),
            names(settings.allowed_headers),
            settings.allow_credentials,
        )

    def wrap(self, app: ASGIApp) -> ASGIApp:
        return CORSMiddleware(
            app,
            allow_origins=self.origins,
            allow_methods=self.methods,
            allow_headers=self.headers,
            allow_credentials=self.credentials,
            expose_headers=EXPOSED,
        )
