"""The `tokenway` command as users run it: `up` in one process, or every stage on its own."""

from __future__ import annotations

import asyncio
import os
import re
import resource
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import nats
import openai
import pytest

from tests.conftest import Bus, guarded_bus, nats_server, wait_engines
from tokenway import bus
from tokenway.config import Settings
from tokenway.registry import EngineRegistry

pytestmark = pytest.mark.asyncio(loop_scope="session")

TOKENWAY = [sys.executable, "-m", "program.cli"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENWAY_SIM_TTFT": "0", "TOKENWAY_SIM_ITL": "0.001"}


async def spawn(*args: str, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *TOKENWAY, *args, env={**ENV, **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def stop(proc: asyncio.subprocess.Process, sig: int = signal.SIGINT) -> int:
    if proc.returncode is None:
        proc.send_signal(sig)
    try:
        return await asyncio.wait_for(proc.wait(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()


async def stream_text(base_url: str) -> str:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0)
    stream = await client.chat.completions.create(
        model="deepseek-v4", messages=[{"role": "user", "content": "hi"}], max_tokens=10,
        stream=True,
    )  # fmt: skip
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def announced_url(proc: asyncio.subprocess.Process) -> str:
    """`tokenway up` prints the URL once the ingress listens."""
    assert proc.stdout is not None
    while line := await asyncio.wait_for(proc.stdout.readline(), 60):
        if match := re.search(r"at (http://\S+/v1)", line.decode()):
            return match.group(1)
    assert proc.stderr is not None
    raise AssertionError((await proc.stderr.read()).decode())


@pytest.fixture
async def up(tmp_path: Path) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    proc = await spawn("up", "--data-dir", str(tmp_path), "--port", "0")
    try:
        yield proc, await announced_url(proc)
    finally:
        await stop(proc, signal.SIGKILL)


async def test_up_serves_a_stream_and_stops_cleanly_on_ctrl_c(up) -> None:
    proc, url = up
    assert await stream_text(url)
    assert await stop(proc) == 0


async def test_each_stage_runs_as_its_own_process(tmp_path: Path) -> None:
    """As an operator deploys it: the streams made as the provision role, then each process
    as its role, with the env file `tokenway nats-auth` writes for it."""
    async with guarded_bus(tmp_path / "nats") as server:
        common = ["--data-dir", str(tmp_path / "data")]
        provision = await spawn("provision", *common, env=server.env("provision"))
        _, err = await provision.communicate()
        assert provision.returncode == 0, err.decode()
        port, metrics = str(free_port()), free_port()
        procs = [
            await spawn("ingress", *common, "--port", port, env=server.env("ingress")),
            await spawn("render", *common, env=server.env("render")),
            await spawn("schedule", *common, "--metrics-port", str(metrics),
                        env=server.env("schedule")),
            await spawn("derender", *common, env=server.env("derender")),
            await spawn("engine", "sim", *common, env=server.env("engine")),
        ]  # fmt: skip
        try:
            await _wait_ready(server.watch, procs[0])
            assert await stream_text(f"http://127.0.0.1:{port}/v1")
            async with httpx.AsyncClient() as http:  # the schedule process's own page
                page = (await http.get(f"http://127.0.0.1:{metrics}/metrics")).text
            assert 'tokenway:request_success_total{finished_reason="length",model_name=' in page
        finally:
            codes = [await stop(p, signal.SIGTERM) for p in procs]
        assert codes == [0] * len(procs)


async def test_model_dir_prints_a_loadable_directory(tmp_path: Path) -> None:
    proc = await spawn("model-dir", "--data-dir", str(tmp_path))
    out, _ = await proc.communicate()
    path = Path(out.decode().strip())
    assert proc.returncode == 0
    assert (path / "tokenizer.json").exists() and (path / "tokenizer_config.json").exists()


async def test_help_lists_the_stages() -> None:
    proc = await spawn("--help")
    out, _ = await proc.communicate()
    for stage in ("up", "ingress", "render", "schedule", "derender", "engine", "model-dir"):
        assert stage in out.decode()


async def logged(proc: asyncio.subprocess.Process, text: bytes) -> None:
    """Until a stage process logs `text` (it logs when it serves); fails if it exits first."""
    assert proc.stderr is not None
    async with asyncio.timeout(60):
        while text not in (line := await proc.stderr.readline()):
            assert line, f"the process exited before logging {text!r}"


# Ports handed out by free_port in this process. A port the kernel picks (bind to 0) is
# free only until the socket closes: the kernel may pick it again for the next call, or for
# any connection's local end, before the server it was for binds it (a cluster's node once
# found its monitor port taken by another node's client port).
_issued: set[int] = set()
_PORTS_PER_WORKER = 4000  # each pytest-xdist worker's own block, below the ephemeral range


def free_port() -> int:
    """A port free now that no other test of this run was given: from this process's block
    under 32768, where the kernel never picks a connection's local port (Linux's ephemeral
    range starts there), one block per pytest-xdist worker."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    first = 16000 + worker * _PORTS_PER_WORKER
    for port in range(first, first + _PORTS_PER_WORKER):
        if port in _issued:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _issued.add(port)
        return port
    raise RuntimeError(f"no free port left in {first}..{first + _PORTS_PER_WORKER}")


async def _wait_ready(nats_url: str, ingress: asyncio.subprocess.Process) -> None:
    """Until the ingress logs that it listens and an engine is in the registry."""
    await logged(ingress, b"listening on")
    async with asyncio.timeout(60):
        nc = await nats.connect(nats_url)
        try:
            registry = EngineRegistry(await bus.engines_kv(nc.jetstream(), Settings()), None, 5.0)
            stop_watch = asyncio.Event()
            watch = asyncio.create_task(registry.run(stop_watch))
            await wait_engines(registry, 1)
            stop_watch.set()
            await watch
        finally:
            await nc.close()


async def test_engine_vllm_bridges_a_vllm_server_as_its_own_process(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from tests.conftest import make_settings, resolve_model, start_stack
    from tests.fakes.vllm_engine import FakeVllm, Knobs

    settings = make_settings(tmp_path / "data", served_model_name="vllm-cli")
    model, served = resolve_model(settings)
    tokenizer = Tokenizer.from_file(str(model.path / "tokenizer.json"))
    fake = FakeVllm.for_tokenizer(
        tokenizer, model.eos_token_ids[0], Knobs(itl=0.001, output_len=20)
    )
    async with guarded_bus(tmp_path / "nats") as server, fake:
        stack = await start_stack(
            server.url, settings, ["ingress", "render", "schedule", "derender"]
        )
        bridge = await spawn(
            "engine", "vllm", "--data-dir", str(tmp_path / "data"), "--served-model-name", served,
            "--vllm-url", fake.url, "--engine-id", "vllm-cli-0", env=server.env("engine"),
        )  # fmt: skip
        try:
            await wait_engines(stack.ingress.registry, 1)
            client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="-", max_retries=0)
            resp = await client.completions.create(model=served, prompt="hi", max_tokens=8)
            assert resp.choices[0].text
            assert [r.body["token_ids"] for r in fake.requests] == [tokenizer.encode("hi").ids]
        finally:
            code = await stop(bridge, signal.SIGTERM)
            await stack.close()
        assert code == 0


async def announcement(proc: asyncio.subprocess.Process) -> dict[str, str]:
    """`tokenway up`'s block once the API listens: the API URL, then a line per part."""
    url = await announced_url(proc)
    assert proc.stdout is not None
    lines = [(await asyncio.wait_for(proc.stdout.readline(), 10)).decode()]
    while not lines[-1].lstrip().startswith("metrics"):
        lines.append((await asyncio.wait_for(proc.stdout.readline(), 10)).decode())
    return {"api": url} | dict(line.strip().split(None, 1) for line in lines)


async def test_up_with_a_vllm_url_serves_that_engine_alone_on_a_fixed_nats_port(
    tmp_path: Path,
) -> None:
    from tokenizers import Tokenizer

    from tests.conftest import make_settings, resolve_model
    from tests.fakes.vllm_engine import FakeVllm, Knobs

    model, _ = resolve_model(make_settings(tmp_path / "data"))
    tokenizer = Tokenizer.from_file(str(model.path / "tokenizer.json"))
    fake = FakeVllm.for_tokenizer(tokenizer, model.eos_token_ids[0], Knobs(itl=0.001))
    port = free_port()
    async with fake:
        proc = await spawn(
            "up", "--data-dir", str(tmp_path / "data"), "--port", "0", "--nats-port", str(port),
            "--vllm-url", fake.url, "--engine-id", "real-0",
        )  # fmt: skip
        try:
            block = await announcement(proc)
            assert block["engines"] == "real-0 (union, deepseek-v4, healthy)"
            assert block["NATS"].startswith(f"nats://127.0.0.1:{port}")
            assert block["models"] == "deepseek-v4" and block["metrics"].endswith("/metrics")
            client = openai.AsyncOpenAI(base_url=block["api"], api_key="-", max_retries=0)
            done = await client.completions.create(model="deepseek-v4", prompt="hi", max_tokens=4)
            assert done.choices[0].text and len(fake.requests) == 1  # no simulated engine
        finally:
            assert await stop(proc) == 0


async def test_up_names_an_engine_not_healthy_yet_and_waits_for_it(tmp_path: Path) -> None:
    proc = await spawn(
        "up", "--data-dir", str(tmp_path), "--port", "0", "--access-log",
        "--vllm-url", f"http://127.0.0.1:{free_port()}", "--engine-id", "late",
    )  # fmt: skip
    try:
        block = await announcement(proc)
        assert block["engines"].startswith("late (union, deepseek-v4, not healthy yet: ")
        async with httpx.AsyncClient() as http:
            ready = await http.get(block["metrics"].replace("/metrics", "/ready"))
        assert ready.status_code == 503 and ready.json()["engines"] == 0
        assert proc.stdout is not None
        logged = await asyncio.wait_for(proc.stdout.readline(), 10)
        assert b'"GET /ready HTTP/1.1" 503' in logged
    finally:
        assert await stop(proc) == 0


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--vllm-url", "http://127.0.0.1:1", "--sim-engines", "1"], "would mix simulated"),
        (["--nats-port", "{taken}"], "nats-server did not start"),
    ],
    ids=["real-and-simulated", "nats-port-taken"],
)
async def test_up_refuses_what_it_cannot_serve_and_says_why(
    tmp_path: Path, args: list[str], says: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        given = [a.replace("{taken}", port) for a in args]
        proc = await spawn("up", "--data-dir", str(tmp_path), "--port", "0", *given)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1, err.decode()
    last = err.decode().strip().splitlines()[-1]
    assert last.startswith("tokenway: ") and says in last, err.decode()
    assert "Traceback" not in err.decode()


async def test_the_version_is_printed() -> None:
    from importlib.metadata import version

    proc = await spawn("--version")
    out, _ = await proc.communicate()
    assert proc.returncode == 0 and out.decode().strip() == f"tokenway {version('tokenway')}"


async def test_every_flag_is_a_setting_and_reaches_it() -> None:
    """A flag that names no setting would be silently ignored: none may."""
    import argparse

    from program.cli import parser
    from tokenway.config import Settings, load_settings

    root = parser()
    # `dir`, `tenant` and `route`: where, for whom and for which cluster nodes `nats-auth`
    # writes; `json`: how `status` prints
    internal = {"help", "version", "command", "kind", "dir", "tenant", "route", "json"}
    stack = [root]
    while stack:
        p = stack.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
            elif action.dest not in internal:
                assert action.dest in Settings.__struct_fields__, action.dest
    args = vars(root.parse_args(["schedule", "--kv-block-size", "32", "--engine-ttl", "9"]))
    settings = load_settings(args, env={})
    assert (settings.kv_block_size, settings.engine_ttl) == (32, 9.0)


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["schedule", "--obfuscation-key-file", "{tmp}/missing"], {}, "cannot read"),
        (["up", "--port", "0"], {"TOKENWAY_OBFUSCATION_KEY": ""}, "holds 0 bytes"),
        (["engine", "sim", "--obfuscation-key", "short"], {}, "needs at least 16"),
    ],
    ids=["missing-file", "empty-env", "short-flag"],
)
async def test_asking_for_obfuscation_without_a_usable_key_refuses_to_start(
    tmp_path: Path, args: list[str], env: dict[str, str], says: str
) -> None:
    """Never a silent start without obfuscation: no NATS is ever contacted (none listens)."""
    argv = [a.format(tmp=tmp_path) for a in args]
    proc = await asyncio.create_subprocess_exec(
        *TOKENWAY, *argv, "--data-dir", str(tmp_path), "--nats", "nats://127.0.0.1:1",
        env={**ENV, **env}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode != 0
    assert "tokenway: " in err.decode() and says in err.decode()
    assert "Traceback" not in err.decode()


# -- starting and stopping when NATS, a port or the data directory is not there to have ------


async def test_a_stage_without_nats_refuses_to_start_and_says_how(tmp_path: Path) -> None:
    """Only `up` embeds a nats-server: a lone stage with no `--nats` would serve an island."""
    env = {k: v for k, v in ENV.items() if k != "TOKENWAY_NATS"}
    proc = await asyncio.create_subprocess_exec(
        *TOKENWAY, "render", "--data-dir", str(tmp_path), env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1
    assert "--nats" in err.decode() and "TOKENWAY_NATS" in err.decode(), err.decode()
    assert "Traceback" not in err.decode()
    assert not (tmp_path / "jetstream").exists()


async def test_a_stage_that_cannot_reach_nats_stops_on_sigterm(tmp_path: Path) -> None:
    """One line per connection attempt, no traceback, and SIGTERM stops it at once."""
    proc = await spawn("schedule", "--nats", "nats://127.0.0.1:1", "--data-dir", str(tmp_path))
    await logged(proc, b"cannot reach NATS")
    assert await stop(proc, signal.SIGTERM) == 0
    assert proc.stderr is not None
    rest = (await proc.stderr.read()).decode()
    assert "Traceback" not in rest


async def test_a_stage_gives_up_on_nats_after_the_connect_timeout(tmp_path: Path) -> None:
    proc = await spawn(  # a stage that loads no chat template: seconds sooner at NATS
        "schedule", "--nats", "nats://127.0.0.1:1", "--connect-timeout", "1",
        "--data-dir", str(tmp_path),
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1
    lines = err.decode().strip().splitlines()
    assert "Traceback" not in err.decode()
    last = "tokenway: cannot connect to nats://127.0.0.1:1: connection refused"
    assert lines[-1].startswith(last), lines[-1]


async def test_a_seed_list_connects_through_any_live_server(tmp_path: Path) -> None:
    # An open bus: this is about reaching a server, which comes before who may do what.
    async with nats_server(tmp_path / "nats", port=free_port()) as server:
        nc = await bus.connect(f"nats://127.0.0.1:1, {server.url}", "test-seeds")
        try:
            assert nc.is_connected
            assert nc.connected_url is not None and nc.connected_url.port == server.port
        finally:
            await nc.close()


async def test_up_on_a_taken_port_stops_its_nats_server_and_says_why(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        proc = await spawn("up", "--data-dir", str(tmp_path), "--port", port)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1
    last = err.decode().strip().splitlines()[-1]
    assert last.startswith("tokenway: ") and port in last, err.decode()
    assert "Traceback" not in err.decode()
    leftover = nats_servers_of(tmp_path)
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    assert leftover == [], "the embedded nats-server outlived `up`"


def nats_servers_of(data_dir: Path) -> list[int]:
    """Running nats-servers whose config names a store under `data_dir`."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue  # it ended meanwhile
        if b"-c" in argv and argv[0].endswith(b"nats-server"):
            conf = Path(argv[argv.index(b"-c") + 1].decode())
            if conf.exists() and str(data_dir) in conf.read_text():
                pids.append(int(cmdline.parent.name))
    return pids


async def test_a_second_up_on_one_data_dir_refuses_naming_the_first(up, tmp_path: Path) -> None:
    first, _ = up
    proc = await spawn("up", "--data-dir", str(tmp_path), "--port", "0")
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1
    assert f"pid {first.pid}" in err.decode() and str(tmp_path) in err.decode(), err.decode()
    assert "Traceback" not in err.decode()


async def test_a_stage_whose_nats_went_away_stops_on_sigterm(tmp_path: Path) -> None:
    """Nothing to drain into: the stage closes its connection and exits cleanly."""
    # An open bus: the test stops the server itself, which `guarded_bus` does not hand out.
    async with nats_server(tmp_path / "nats", port=free_port()) as server:
        proc = await spawn("schedule", "--nats", server.url, "--data-dir", str(tmp_path / "d"))
        await logged(proc, b"owning")
        await asyncio.to_thread(server.stop)
        # "NATS error at …", or "cannot reach NATS at …" when nats-py was already
        # reconnecting as it reported the loss (one run in the suite, under load)
        await logged(proc, b"NATS")
        code = await stop(proc, signal.SIGTERM)
        assert proc.stderr is not None
        said = (await proc.stderr.read()).decode()
        assert code == 0, said
        assert "Traceback" not in said


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's exit waits for its reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_the_embedded_nats_server_logs_to_the_data_dir_and_dies_with_up(
    up, tmp_path: Path
) -> None:
    """Its output is drained to a file (a pipe nobody reads fills, then blocks the server),
    and a SIGKILLed `up` takes it along instead of leaving an orphan on the store."""
    proc, _ = up
    [server] = nats_servers_of(tmp_path)
    assert "Server is ready" in (tmp_path / "nats-server.log").read_text()
    proc.send_signal(signal.SIGKILL)
    await proc.wait()
    async with asyncio.timeout(10):
        while running(server):  # noqa: ASYNC110 - another process: nothing to wait on
            await asyncio.sleep(0.05)


# -- secrets on the command line ---------------------------------------------------------------

SECRET = "sk-cmdline-0123456789abcdef"
NO_NATS = ["--nats", "nats://127.0.0.1:1"]


@pytest.mark.parametrize(
    ("args", "flag", "env"),
    [
        (["ingress", *NO_NATS, "--api-key", SECRET], "--api-key", "TOKENWAY_API_KEY"),
        (["schedule", *NO_NATS, "--obfuscation-key", SECRET], "--obfuscation-key",
         "TOKENWAY_OBFUSCATION_KEY"),
        (["status", *NO_NATS, "--nats-user", "u", "--nats-password", SECRET], "--nats-password",
         "TOKENWAY_NATS_PASSWORD"),
        (["status", *NO_NATS, "--nats-token", SECRET], "--nats-token", "TOKENWAY_NATS_TOKEN"),
        (["status", "--nats", f"nats://u:{SECRET}@127.0.0.1:1"], "--nats", "TOKENWAY_NATS"),
    ],
    ids=["api-key", "obfuscation-key", "nats-password", "nats-token", "nats-url"],
)  # fmt: skip
async def test_a_secret_on_the_command_line_starts_with_a_warning_naming_the_safe_ways(
    tmp_path: Path, args: list[str], flag: str, env: str
) -> None:
    """Every local user reads a process's arguments (`ps`, /proc/PID/cmdline); the same secret
    from the environment or a file starts without a word about it."""
    common = ["--connect-timeout", "1", "--data-dir", str(tmp_path)] if args[0] != "status" else []
    proc = await spawn(*args, *common)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    warnings = [line for line in err.decode().splitlines() if line.startswith("tokenway: warning")]
    assert len(warnings) == 1, err.decode()
    [warning] = warnings
    assert warning.startswith(f"tokenway: warning: {flag} ") and "/proc/" in warning
    assert env in warning and SECRET not in warning

    value = args[args.index(flag) + 1]
    rest = [a for i, a in enumerate(args) if a != flag and (i == 0 or args[i - 1] != flag)]
    if flag != "--nats":
        rest += NO_NATS * ("--nats" not in rest)
    proc = await spawn(*rest, *common, env={env: value})
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode != 0  # (no NATS: it got as far as looking for one)
    assert "tokenway: warning" not in err.decode(), err.decode()


async def test_a_stage_raises_its_open_files_limit_to_the_systems(
    session_bus: Bus, tmp_path: Path
) -> None:
    """Every connection is a file: a stage started under systemd's soft limit of 1024 ran
    out of files near a thousand clients, before --max-connections-per-address could act."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, hard, 256)
    env = {**session_bus.env("derender"), "TOKENWAY_LOG_LEVEL": "info"}
    proc = await asyncio.create_subprocess_exec(
        *TOKENWAY, "derender", "--data-dir", str(tmp_path), env={**ENV, **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)),
    )  # fmt: skip
    try:
        await logged(proc, b"derender serving")
        limits = Path(f"/proc/{proc.pid}/limits").read_text()  # noqa: ASYNC240
        (line,) = [x for x in limits.splitlines() if x.startswith("Max open files")]
        assert int(line.split()[3]) == (hard if hard != resource.RLIM_INFINITY else 1 << 20)
    finally:
        await stop(proc, signal.SIGTERM)
