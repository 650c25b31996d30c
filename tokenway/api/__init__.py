"""The OpenAI, Anthropic Messages and Responses APIs: request and response schemas, and the
translations of Messages and Responses into the chat request every stage works on."""
