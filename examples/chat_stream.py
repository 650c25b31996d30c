"""Stream a chat completion from tokenway with the openai SDK.

TOKENWAY_URL=http://127.0.0.1:8000/v1 python examples/chat_stream.py
"""

import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("TOKENWAY_URL", "http://127.0.0.1:8000/v1"), api_key="-")
stream = client.chat.completions.create(
    model="deepseek-v4",
    messages=[{"role": "user", "content": "Say hello in three languages."}],
    max_tokens=40,
    stream=True,
)
for chunk in stream:
    for choice in chunk.choices:
        print(choice.delta.content or "", end="", flush=True)
print()
