"""Render: chat template and tokenization."""
