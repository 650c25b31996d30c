"""Derender: token IDs back into OpenAI output."""
