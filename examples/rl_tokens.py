"""An RL rollout step straight over the bus: token IDs in, token IDs and logprobs out.

    set -a; . ~/.local/share/tokenway/nats-auth/client-default.env; set +a
    python examples/rl_tokens.py --model deepseek-v4

It joins the bus as the environment says (`Client.from_env`): the file above is what
`tokenway up` writes for the jobs of a tenant (its ready block names each one): the NATS URL,
the tenant's client user and the tenant. Against a bus of your own, set `TOKENWAY_NATS` and
its credentials (`TOKENWAY_NATS_CREDS`, ...) instead.

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
    p.add_argument("--model", default="deepseek-v4")
    args = p.parse_args()
    prompt = [6366, 33, 1040, 285]  # already tokenized by the trainer
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, logprobs=0)
    async with await Client.from_env(args.model) as tw:
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
