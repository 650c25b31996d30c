"""An RL rollout step straight over the bus: token IDs in, token IDs and logprobs out.

python examples/rl_tokens.py --nats nats://127.0.0.1:4222 --model deepseek-v4

vLLM's token-only generate body goes to the schedule stage (no chat template, no
tokenizer on this side); each sample comes back with the IDs the engine produced and their
logprobs, exactly as it produced them.
"""

import argparse
import asyncio
import json

from tokenway.client import Client
from tokenway.wire import GenerateRequest, SamplingParams


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nats", default="nats://127.0.0.1:4222")
    p.add_argument("--model", default="deepseek-v4")
    args = p.parse_args()
    prompt = [6366, 33, 1040, 285]  # already tokenized by the trainer
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, logprobs=0)
    async with await Client.connect(args.nats, args.model) as tw:
        done = await tw.run(
            GenerateRequest(
                request_id="rollout-1",
                token_ids=prompt,
                sampling_params=params,
                return_token_ids=True,
            )
        )
    for choice in done["choices"]:
        logprobs = choice["logprobs"]["token_logprobs"]
        print(json.dumps({"ids": choice["token_ids"], "logprobs": logprobs}))


if __name__ == "__main__":
    asyncio.run(main())
