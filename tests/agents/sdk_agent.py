"""One Agents SDK run against tokenway, in the agents tier's own venv (`openai-agents` pins
a websockets the project's venv does not take): an Agent with one function tool, its first
turn forced to call it, on Responses or Chat Completions, streamed or not.

    python tests/agents/sdk_agent.py BASE_URL MODEL {responses,chat} {run,streamed}

Prints one JSON object: the tool's calls (their arguments as the tool got them), the
run's item types in order, and the final output.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

calls: list[dict[str, str]] = []


@function_tool
def lookup_city(city: str) -> str:
    """The weather in a city."""
    calls.append({"city": city})
    return f"It is sunny in {city}."


async def main(base_url: str, model: str, api: str, mode: str) -> None:
    set_tracing_disabled(True)  # no traces sent to OpenAI's platform
    client = AsyncOpenAI(base_url=base_url, api_key=os.environ["TOKENWAY_AGENT_KEY"], max_retries=0)
    kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(
        name="weather",
        instructions="Answer with the weather, using the tool.",
        model=kind(model=model, openai_client=client),
        tools=[lookup_city],
        # The SDK sets tool_choice back to auto after a call (reset_tool_choice), so the
        # forced first turn is followed by one that may answer in text.
        model_settings=ModelSettings(tool_choice="required", max_tokens=64),
    )
    prompt = "What is the weather in Paris?"
    if mode == "streamed":
        result = Runner.run_streamed(agent, prompt, max_turns=4)
        events = [event.type async for event in result.stream_events()]
    else:
        result = await Runner.run(agent, prompt, max_turns=4)
        events = []
    print(json.dumps({
        "calls": calls,
        "items": [item.type for item in result.new_items],
        "final_output": result.final_output,
        "stream_events": len(events),
    }))  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
