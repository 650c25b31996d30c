"""The OpenAI HTTP API in front of the bus."""
