"""The shipped deployments (infra/compose.yaml, infra/k8s/) as an operator's static check
reads them: every container's command parses with tokenway's own parser and makes settings
that connect as the role of what it runs, with that role's seed and nothing else of the
others'; every stage serves its metrics where Prometheus scrapes them; Grafana gets the
shipped dashboard. Where the tools answer, the files are also checked by kubectl, Compose and
the schemas, and compose is brought up and streams a chat (docs/operations.md's commands)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from program import cli
from tests.conftest import Bus, guarded_bus
from tests.stages import READY
from tests.test_cli import free_port, logged, spawn, stop
from tokenway import bus
from tokenway.config import Settings, load_settings
from tokenway.roles import roles

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
COMPOSE = yaml.safe_load((INFRA / "compose.yaml").read_text())
K8S = [d for d in yaml.safe_load_all((INFRA / "k8s" / "tokenway.yaml").read_text()) if d]
MONITORING = yaml.safe_load((INFRA / "k8s" / "monitoring.yaml").read_text())
PROMETHEUS = yaml.safe_load((INFRA / "prometheus" / "prometheus.yml").read_text())
AUTH_VOLUME, AUTH_SECRET = "nats-auth", "tokenway-nats-auth"
# What the image sets for every container (infra/Dockerfile's ENV).
IMAGE_ENV = {"TOKENWAY_DATA_DIR": "/data", "TOKENWAY_NATS": "nats://nats:4222"}
# Every role a deployment runs: `ops` is a person's `tokenway dlq` and `status`.
DEPLOYED = {r.name for r in roles()} - {"ops"}


@dataclass(frozen=True)
class Container:
    where: str  # "compose render", "k8s tokenway-render"
    argv: list[str]  # after the image's `tokenway` entrypoint
    env: dict[str, str]  # as the process sees it
    seeds: dict[str, str]  # path in the container -> file of the auth volume or secret
    grace: float  # seconds from the stop signal to the kill

    @property
    def role(self) -> str:
        return self.argv[0]  # `tokenway <stage>`, `engine sim`, `dlq move`: the role first

    @property
    def runs(self) -> bool:
        """A stage that runs until stopped (provision exits once the streams exist)."""
        return self.role != "provision"

    def settings(self) -> Settings:
        """What `program.cli.main` makes of this command line and environment."""
        own = {"dlq": cli.dlq_parser, "batch": cli.batch_parser}.get(self.argv[0])
        try:
            args = own().parse_args(self.argv[1:]) if own else cli.parser().parse_args(self.argv)
        except SystemExit as exc:
            raise AssertionError(f"{self.where}: `tokenway {' '.join(self.argv)}` does not "
                                 f"parse (status {exc.code})") from None  # fmt: skip
        flags = {k.replace("-", "_"): v for k, v in vars(args).items()}
        return load_settings(flags, {**IMAGE_ENV, **self.env})


def compose_containers() -> list[Container]:
    """Every service that runs the tokenway image, but the one that writes the seeds."""
    found = []
    for name, service in COMPOSE["services"].items():
        if "build" not in service or service["command"][0] == "nats-auth":
            continue
        seeds = {}
        for mount in service.get("volumes", []):
            if isinstance(mount, str):  # short syntax: `source:target[:mode]`, the whole volume
                source, target = mount.split(":")[:2]
                mount = {"source": source, "target": target}
            if mount.get("source") == AUTH_VOLUME:
                seeds[mount["target"]] = mount.get("volume", {}).get("subpath", "/")
        grace = float(service.get("stop_grace_period", "10s").removesuffix("s"))  # Docker's 10 s
        found.append(Container(f"compose {name}", service["command"],
                               dict(service.get("environment", {})), seeds, grace))  # fmt: skip
    return found


def config_maps() -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d["data"] for d in K8S if d["kind"] == "ConfigMap"}


def pods() -> Iterator[tuple[dict, dict]]:
    """(document, pod template) of each Deployment and Job."""
    for doc in K8S:
        if doc["kind"] in ("Deployment", "Job"):
            yield doc, doc["spec"]["template"]


def k8s_containers() -> list[Container]:
    found = []
    for doc, pod in pods():
        (container,) = pod["spec"]["containers"]
        env = {}
        for source in container.get("envFrom", []):
            env |= config_maps()[source["configMapRef"]["name"]]
        env |= {e["name"]: e["value"] for e in container.get("env", [])}
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        seeds = {}
        for mount in container.get("volumeMounts", []):
            secret = volumes[mount["name"]].get("secret", {})
            if secret.get("secretName") != AUTH_SECRET:
                continue
            for item in secret.get("items", [{"key": "/", "path": ""}]):  # none: every key
                seeds[f"{mount['mountPath']}/{item['path']}".rstrip("/")] = item["key"]
        grace = pod["spec"].get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
        found.append(Container(f"k8s {doc['metadata']['name']}", container["args"], env, seeds,
                               grace))  # fmt: skip
    return found


CONTAINERS = compose_containers() + k8s_containers()


@pytest.mark.parametrize("c", CONTAINERS, ids=lambda c: c.where)
def test_every_container_connects_as_the_role_of_what_it_runs(c: Container) -> None:
    s = c.settings()
    assert s.nats_nkey_file == f"/auth/{c.role}.nk", c.where
    assert s.nats_inbox_prefix == bus.inbox_prefix(c.role), c.where
    if c.role != "provision":  # which `tokenway provision` is whatever its settings say
        assert s.provision is False, c.where  # only provision may create or change streams


@pytest.mark.parametrize("c", CONTAINERS, ids=lambda c: c.where)
def test_every_container_mounts_its_own_roles_seed_and_no_other(c: Container) -> None:
    assert c.seeds == {f"/auth/{c.role}.nk": f"{c.role}.nk"}, c.where


@pytest.mark.parametrize("c", [c for c in CONTAINERS if c.runs], ids=lambda c: c.where)
def test_every_stage_serves_its_metrics_to_the_network(c: Container) -> None:
    s = c.settings()
    assert (s.metrics_host, s.metrics_port) == ("0.0.0.0", 9090), c.where


@pytest.mark.parametrize("c", [c for c in CONTAINERS if c.runs], ids=lambda c: c.where)
def test_every_stage_is_given_its_drain_before_it_is_killed(c: Container) -> None:
    # Killed mid-drain, a schedule worker hands nothing over: its streams wait out
    # --owner-ack-wait instead.
    assert c.grace > c.settings().drain_timeout, c.where


def test_both_deployments_run_every_role() -> None:
    assert {c.role for c in compose_containers()} == DEPLOYED
    assert {c.role for c in k8s_containers()} == DEPLOYED


def test_nats_gets_the_authorization_and_no_seed_and_publishes_nothing() -> None:
    nats = COMPOSE["services"]["nats"]
    auth = [m for m in nats["volumes"] if isinstance(m, dict) and m["source"] == AUTH_VOLUME]
    conf = "/etc/nats/auth/auth.conf"
    assert auth == [{"type": "volume", "source": AUTH_VOLUME, "read_only": True,
                     "target": conf, "volume": {"subpath": "auth.conf"}}]  # fmt: skip
    assert not any(str(m).startswith(f"{AUTH_VOLUME}:") for m in nats["volumes"])
    assert "ports" not in nats


def test_prometheus_scrapes_every_stage_of_compose() -> None:
    (job,) = PROMETHEUS["scrape_configs"]
    scraped = {
        (name, sd["port"])
        for sd in job["dns_sd_configs"]
        if sd["type"] == "A"  # every container of a scaled service, not one of them
        for name in sd["names"]
    }
    assert job.get("metrics_path", "/metrics") == "/metrics"
    for c in compose_containers():
        if c.runs:
            assert (c.where.removeprefix("compose "), c.settings().metrics_port) in scraped


def test_every_k8s_stage_pod_is_annotated_and_monitored() -> None:
    monitor = MONITORING["spec"]
    assert MONITORING["kind"] == "PodMonitor"
    (endpoint,) = monitor["podMetricsEndpoints"]
    for doc, pod in pods():
        (container,) = pod["spec"]["containers"]
        c = next(c for c in k8s_containers() if c.where == f"k8s {doc['metadata']['name']}")
        if not c.runs:
            continue
        port = c.settings().metrics_port
        assert pod["metadata"]["annotations"] == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics",
        }, c.where
        labels = pod["metadata"]["labels"]
        assert monitor["selector"]["matchLabels"].items() <= labels.items(), c.where
        named = {p.get("name"): p["containerPort"] for p in container["ports"]}
        assert named[endpoint["port"]] == port and endpoint["path"] == "/metrics", c.where


def test_the_ingress_is_ready_only_with_an_engine_in_k8s() -> None:
    """/ready is the ingress's readiness probe, and it is 503 until an engine registers: the
    manifest runs one (the vLLM bridge, at the Service the operator names)."""
    ingress = next(p for d, p in pods() if d["metadata"]["name"] == "tokenway-ingress")
    (container,) = ingress["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    replicas = {d["metadata"]["name"]: d["spec"]["replicas"] for d, _ in pods()
                if d["kind"] == "Deployment"}  # fmt: skip
    engines = {c.where.removeprefix("k8s "): c for c in k8s_containers() if c.role == "engine"}
    assert replicas["tokenway-engine-vllm"] >= 1 and replicas["tokenway-engine-sim"] == 0
    assert engines["tokenway-engine-vllm"].settings().vllm_url == "http://vllm:8000"
    assert "TOKENWAY_VLLM_URL" in config_maps()["tokenway-vllm"]  # where the operator names it


def test_a_plain_compose_up_runs_the_simulated_engine_and_the_vllm_profile_its_bridge() -> None:
    services = COMPOSE["services"]
    default = {n for n, s in services.items() if not s.get("profiles")}
    assert {"ingress", "render", "schedule", "derender", "engine-sim"} <= default
    assert services["engine-sim"]["command"][:2] == ["engine", "sim"]
    assert services["engine-vllm"]["profiles"] == ["vllm"]
    assert services["engine-vllm"]["command"][:2] == ["engine", "vllm"]
    bridge = next(c for c in compose_containers() if c.where == "compose engine-vllm")
    assert bridge.settings().vllm_url == "${VLLM_URL:-http://vllm:8000}"  # Compose fills it


def test_grafana_is_provisioned_with_the_shipped_dashboard() -> None:
    grafana = COMPOSE["services"]["grafana"]
    mounts = dict(reversed(m.removesuffix(":ro").split(":")) for m in grafana["volumes"])
    provisioning = INFRA / mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["isDefault"]
    assert source["url"] == "http://prometheus:9090" and "prometheus" in COMPOSE["services"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "tokenway.yml").read_text())[
        "providers"
    ]
    dashboards = {Path(t).parent.as_posix(): INFRA / s for t, s in mounts.items()
                  if t.endswith(".json")}  # fmt: skip
    shipped = dashboards[provider["options"]["path"]]
    assert shipped.resolve() == INFRA / "grafana" / "tokenway.json"
    variables = json.loads(shipped.read_text())["templating"]["list"]
    assert {"type": "datasource", "query": "prometheus"}.items() <= variables[0].items()


# --- the tools, where they answer ------------------------------------------------------------


def run(*argv: str, timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]


def test_kubectl_client_dry_run_accepts_the_manifests() -> None:
    if not shutil.which("kubectl"):
        pytest.skip("no kubectl on PATH")
    result = run("kubectl", "apply", "--dry-run=client", "-f", str(INFRA / "k8s" / "tokenway.yaml"))
    offline = ("connection refused", "unable to recognize", "failed to download openapi")
    if result.returncode and any(text in result.stderr for text in offline):
        pytest.skip("kubectl's client dry run still asks an API server for its kinds, and none "
                    f"answers: {result.stderr.strip().splitlines()[0]}")  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_the_k8s_manifests_match_the_kubernetes_schemas() -> None:
    """Offline, unlike kubectl: each document against the API's schemas, unknown fields
    refused (the PodMonitor is a custom resource, checked by the test above it)."""
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")
    for doc in K8S:
        kv.validate(doc, "1.30.0", strict=True)


def test_the_compose_file_matches_the_compose_spec() -> None:
    if not shutil.which("check-jsonschema"):
        pytest.skip("check-jsonschema (its vendored compose-spec schema) not installed")
    result = run("check-jsonschema", "--builtin-schema", "vendor.compose-spec",
                 str(INFRA / "compose.yaml"))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def compose_cli() -> list[str]:
    for argv in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(argv[0]) and run(*argv, "version").returncode == 0:
            return argv
    pytest.skip("no docker compose (the plugin or docker-compose) on PATH")


def test_docker_compose_config_accepts_the_file_with_each_profile() -> None:
    compose = compose_cli()
    for profile in ("sim", "vllm"):
        result = run(*compose, "-f", str(INFRA / "compose.yaml"), "--profile", profile,
                     "config", "--quiet")  # fmt: skip
        assert result.returncode == 0, result.stderr


def test_promtool_accepts_the_prometheus_config() -> None:
    if not shutil.which("promtool"):
        pytest.skip("no promtool on PATH")
    result = run("promtool", "check", "config", str(INFRA / "prometheus" / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


# --- compose up ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Up:
    api: str  # the API's URL
    compose: list[str]  # `docker compose -p <project> -f infra/compose.yaml`
    env: dict[str, str]


@pytest.fixture
def compose_up() -> Iterator[Up]:
    """docs/operations.md's `docker compose ... up -d --build --wait` on free ports, taken
    down with its volumes whatever the test does."""
    compose = compose_cli()
    if run("docker", "info").returncode != 0:
        pytest.skip("no Docker daemon answers `docker info`")
    ports = {"TOKENWAY_API_PORT": free_port(), "PROMETHEUS_PORT": free_port(),
             "GRAFANA_PORT": free_port()}  # fmt: skip
    env = {**os.environ, **{k: str(v) for k, v in ports.items()}}
    project = [*compose, "-p", f"tokenway-test-{uuid.uuid4().hex[:8]}",
               "-f", str(INFRA / "compose.yaml")]  # fmt: skip
    try:
        up = run(*project, "up", "-d", "--build", "--wait", "--wait-timeout", "900",
                 timeout=1800, env=env)  # fmt: skip
        logs = run(*project, "logs", "--no-color", env=env).stdout[-20000:]
        assert up.returncode == 0, up.stderr + logs
        yield Up(f"http://127.0.0.1:{ports['TOKENWAY_API_PORT']}", project, env)
    finally:
        run(*project, "down", "-v", "--remove-orphans", timeout=300, env=env)


@pytest.mark.timeout(2400)
def test_compose_up_streams_a_chat_and_every_stage_serves_prometheus(compose_up: Up) -> None:
    client = openai.OpenAI(base_url=f"{compose_up.api}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="deepseek-v4", messages=[{"role": "user", "content": "Hello"}],
        max_tokens=16, stream=True,
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # What Prometheus scrapes, read from its own container by the names it is configured with.
    (job,) = PROMETHEUS["scrape_configs"]
    (sd,) = job["dns_sd_configs"]
    for name in sd["names"]:
        if COMPOSE["services"][name].get("profiles"):
            continue  # not in a plain `up`
        url = f"http://{name}:{sd['port']}/metrics"
        page = run(*compose_up.compose, "exec", "-T", "prometheus", "wget", "-qO-", url,
                   env=compose_up.env)  # fmt: skip
        assert page.returncode == 0 and "tokenway_" in page.stdout, (url, page.stderr)


def test_the_operations_guide_shows_what_the_compose_test_runs_and_names_real_files() -> None:
    guide = (ROOT / "docs" / "operations.md").read_text()
    for command in ("docker compose -f infra/compose.yaml up -d --build --wait",
                    "docker compose -f infra/compose.yaml down -v"):  # fmt: skip
        assert command in guide
    named = set(re.findall(r"(?<![\w/])infra/[\w./-]*\w", guide))
    assert named, "the guide names no file of infra/"
    named = {n for n in named if not n.startswith("infra/nats/auth")}  # the operator makes it
    assert [n for n in sorted(named) if not (ROOT / n).exists()] == []


# --- compose's commands, without Docker ------------------------------------------------------


def as_process(c: Container, bus_: Bus, data: Path, ports: dict[int, int]) -> tuple[list, dict]:
    """`c`'s command and environment for a process on this host: its seed where
    `tokenway nats-auth` wrote it, the bus's URL, and each of its ports on a free one."""
    argv = [str(ports.setdefault(int(a), free_port())) if a in ("8000", "9090") else a
            for a in c.argv]  # fmt: skip
    assert bus_.users is not None
    seed = bus_.users.directory / Path(c.env["TOKENWAY_NATS_NKEY_FILE"]).name
    env = {**c.env, "TOKENWAY_NATS_NKEY_FILE": str(seed), "TOKENWAY_NATS": bus_.url,
           "TOKENWAY_DATA_DIR": str(data)}  # fmt: skip
    return argv, env


async def said(name: str, proc: asyncio.subprocess.Process, text: bytes) -> None:
    try:
        await logged(proc, text)
    except (AssertionError, TimeoutError) as exc:
        raise AssertionError(f"compose {name} did not log {text!r}: {exc!r}") from None


@pytest.mark.timeout(300)
async def test_compose_commands_serve_a_chat_each_as_its_role_without_docker(
    tmp_path: Path,
) -> None:
    """What the compose-up test checks, where no Docker daemon answers: each container's
    command and environment as a process, against a server that lets in the role users only.
    Provision creates the streams, every stage serves its metrics on 0.0.0.0 and a chat
    streams through them all."""
    containers = {c.where.removeprefix("compose "): c for c in compose_containers()}
    stages = [n for n, s in COMPOSE["services"].items()
              if n in containers and n != "provision" and not s.get("profiles")]  # fmt: skip
    async with guarded_bus(tmp_path / "nats") as bus_:
        argv, env = as_process(containers["provision"], bus_, tmp_path / "data", {})
        provision = await spawn(*argv, env=env)
        _, err = await provision.communicate()
        assert provision.returncode == 0, err.decode()
        procs, metrics = {}, {}
        try:
            for name in stages:
                ports: dict[int, int] = {}
                argv, env = as_process(containers[name], bus_, tmp_path / "data", ports)
                procs[name] = await spawn(*argv, env=env)
                metrics[name] = ports[9090]
                if name == "ingress":
                    api = f"http://127.0.0.1:{ports[8000]}"
            for name, proc in procs.items():
                await said(name, proc, f"metrics at http://0.0.0.0:{metrics[name]}/".encode())
            for name, proc in procs.items():
                ready = {**READY, "batch": b"running batches"}.get(containers[name].role)
                if ready:  # (the dead-letter mover says nothing until it moves one)
                    await said(name, proc, ready)
            client = openai.AsyncOpenAI(base_url=f"{api}/v1", api_key="-", max_retries=0)
            stream = await client.chat.completions.create(
                model="deepseek-v4", messages=[{"role": "user", "content": "Hello"}],
                max_tokens=8, stream=True,
            )  # fmt: skip
            chunks = [c async for c in stream if c.choices]
            assert "".join(c.choices[0].delta.content or "" for c in chunks)
            async with httpx.AsyncClient(timeout=10) as http:
                for name, port in metrics.items():
                    page = await http.get(f"http://127.0.0.1:{port}/metrics")
                    assert page.status_code == 200 and "tokenway_" in page.text, name
            assert {n: p.returncode for n, p in procs.items()} == dict.fromkeys(procs)
        finally:
            for proc in procs.values():
                await stop(proc, signal.SIGKILL)


def test_the_image_holds_every_package_the_install_names() -> None:
    """The image installs from what it copies: a package left out (`program/`, issue 33's
    top floor) would leave `tokenway` without its command."""
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {p.rstrip("*") for p in include["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\w+) \./\1$", (INFRA / "Dockerfile").read_text(), re.M))
    assert packages == copied
    assert packages == {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
