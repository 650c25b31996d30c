"""tokenway: an OpenAI-compatible serving front for token-in/token-out engines, over NATS."""

__version__ = "0.1.0"
