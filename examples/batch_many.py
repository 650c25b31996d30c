"""Many OpenAI requests over the bus, a bounded number at a time.

    set -a; . ~/.local/share/tokenway/nats-auth/client-default.env; set +a
    python examples/batch_many.py --model deepseek-v4 --count 100

It joins the bus as `examples/rl_tokens.py` does (`Client.from_env`: what `tokenway up`
writes for a tenant's jobs). `submit_many` keeps `--concurrency` requests in flight, waits
whenever the queue is full, and names each request by its line, so running the script
again runs nothing twice.
"""

import argparse
import asyncio
import json

from tokenway.client import Client, RequestFailed


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-v4")
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--job", default="batch-many", help="names the job's output subjects")
    args = p.parse_args()
    bodies = [
        (f"line-{i}", {"messages": [{"role": "user", "content": f"Fact #{i}?"}], "max_tokens": 8})
        for i in range(args.count)
    ]
    failed = 0
    async with await Client.from_env(args.model, reply=args.job) as tw:
        async for rid, result in tw.submit_many(bodies, concurrency=args.concurrency):
            if isinstance(result, RequestFailed):
                failed += 1
                print(json.dumps({"id": rid, "error": str(result)}))
            else:
                text = result["choices"][0]["message"]["content"]
                print(json.dumps({"id": rid, "text": text}))
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    asyncio.run(main())
