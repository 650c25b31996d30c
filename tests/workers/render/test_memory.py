"""What rendering a big prompt takes, the process gives back: glibc kept what the tokenizer
freed in its worker thread's arena (600 MB after one 7 MB prompt under `tokenway up`, 3.4 GB
after four at once), and, trimmed, still held 0 to 42 MB by how the blocks fell. Measured in a
process of its own, set up as `tokenway`'s process start sets it, and rendering the way the
render shell does (one event loop, in its worker threads)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

MB = 1024 * 1024

# Render a 1.25 MB prompt of words four times the way the render shell does (in a worker
# thread): a 400 once tokenized (250,000 tokens), so the tokenizer did its work for nothing.
SCRIPT = """
import asyncio, json, sys, threading, time
from pathlib import Path
from tokenway import heap
from tokenway.errors import InvalidRequest
from tokenway.model import load_model_info
from tokenway.wire import RenderRequest
from workers.render.backend import LocalBackend
from workers.render.core import Renderer

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))

heap.map_big_blocks()
backend = LocalBackend(Renderer(load_model_info(Path(sys.argv[1])), "deepseek-v4"))

def request(prompt):
    body = json.dumps({"prompt": prompt}).encode()
    return RenderRequest(api="completion", request_id="r", body=body, created=1)

asyncio.run(backend.render(request("word " * 20_000)))  # warm: a 100 KB one, served
peak, done = 0, threading.Event()
def watch():
    global peak
    while not done.is_set():
        peak = max(peak, rss())
        time.sleep(0.005)
before = rss()
watcher = threading.Thread(target=watch)
watcher.start()
held = []
async def refused_four_times():
    for _ in range(4):
        try:
            await backend.render(request("word " * 250_000))
        except InvalidRequest as exc:
            assert exc.code == "context_length_exceeded", exc
        held.append(rss() - before)
asyncio.run(refused_four_times())
done.set()
watcher.join()
print(json.dumps({"peak": peak - before, "held": held}))
"""


def test_a_big_prompt_leaves_the_render_process_where_it_was(model_dir: Path) -> None:
    root = Path(__file__).resolve().parents[3]
    ran = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir)], cwd=root,
                         capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    rss = json.loads(ran.stdout.splitlines()[-1])
    assert rss["peak"] > 100 * MB, rss  # the work was big
    assert max(rss["held"]) < 12 * MB, rss  # and is given back, each time
