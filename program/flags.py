"""The flags of the stage commands, in groups a command picks (every flag is a setting:
`tokenway.config`)."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

log = logging.getLogger("tokenway")


def common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("common")
    g.add_argument(
        "--nats",
        help="NATS server URL, or a comma-separated seed list of a cluster's servers "
        "(TOKENWAY_NATS); `up` without it embeds a nats-server, other stages need it",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        help="seconds open streams and owned requests get to finish on SIGTERM/SIGINT (20)",
    )
    g.add_argument(
        "--provision",
        action=argparse.BooleanOptionalAction,
        help="create or update the streams at start (default); --no-provision waits until "
        "they exist, as `tokenway provision` makes them (a least-privilege role may not touch "
        "them)",
    )
    g.add_argument(
        "--replicas",
        type=int,
        help="replicas of each stream and bucket it creates, or raises (TOKENWAY_REPLICAS; "
        "default 0: the cluster's servers up to 3, 1 on a lone server); provision never lowers "
        "a stream's replicas, it refuses",
    )
    g.add_argument(
        "--connect-timeout",
        type=float,
        help="seconds to keep trying to reach NATS at start before exiting with status 1 (30)",
    )
    nats_credentials(p)
    g.add_argument("--data-dir", help="state directory (JetStream store, model dir)")
    g.add_argument(
        "--model-dir",
        help="a local Hugging Face model directory (default: bundled DeepSeek-V4 tokenizer)",
    )
    g.add_argument("--served-model-name", help="the model name clients use")
    g.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="NAME[=DIR]",
        help="serve a model under NAME, from a local Hugging Face directory (without DIR: the "
        "bundled tokenizer); repeatable, in place of --model-dir and --served-model-name",
    )
    g.add_argument("--max-model-len", type=int, help="cap the context length, in tokens")
    g.add_argument(
        "--context-budget",
        choices=["on", "off"],
        help="on: clip a max_tokens that does not fit the context (default off: a 400)",
    )
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    g.add_argument(
        "--otlp-endpoint",
        help="send each stage's spans of a request to this OTLP/HTTP collector, e.g. "
        "http://127.0.0.1:4318 (needs the otel extra; default: no spans)",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        help="serve this process's metrics at http://HOST:PORT/metrics (default: none); an "
        "ingress's API /metrics is the same page",
    )
    g.add_argument(
        "--metrics-host",
        help="where --metrics-port listens (default 127.0.0.1; 0.0.0.0 in a container, for "
        "the scraper)",
    )
    g.add_argument(
        "--engine-ttl", type=float, help="seconds an engine stays registered without a beat (5)"
    )
    g.add_argument(
        "--request-timeout", type=float, help="default deadline of a request, seconds (600)"
    )


def nats_credentials(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "NATS credentials (one way; each flag also reads TOKENWAY_<FLAG>; prefer the files)"
    )
    g.add_argument("--nats-user", help="user name, with a password")
    g.add_argument("--nats-password", help="password (prefer --nats-password-file)")
    g.add_argument("--nats-password-file", help="read the password from this file")
    g.add_argument("--nats-token", help="token (prefer --nats-token-file)")
    g.add_argument("--nats-token-file", help="read the token from this file")
    g.add_argument("--nats-nkey-file", help="an nkey seed file (SU...)")
    g.add_argument("--nats-creds", help="a .creds file: user JWT and nkey seed")
    g.add_argument("--nats-tls-ca", help="CA certificate(s) to trust for the server (PEM)")
    g.add_argument("--nats-tls-cert", help="client certificate for mutual TLS (PEM)")
    g.add_argument("--nats-tls-key", help="its private key (PEM)")
    g.add_argument(
        "--nats-inbox-prefix",
        help="where this process's replies arrive (default: its role's own, _INBOX.<role>, "
        "as `tokenway nats-auth` gives each role; under `up --nats`, _INBOX)",
    )


def scheduling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduling")
    g.add_argument("--kv-block-size", type=int, help="KV block size for affinity hashes (16)")
    g.add_argument(
        "--prefill-scale", type=float, help="weight of uncached prompt blocks vs load (1.0)"
    )
    g.add_argument("--affinity-ttl", type=float, help="seconds a routed prefix counts (300)")
    g.add_argument(
        "--breaker-threshold", type=int, help="engine failures in a row that open its breaker (3)"
    )
    g.add_argument("--max-inflight", type=int, help="requests one schedule worker owns (1024)")
    g.add_argument(
        "--owner-lookahead",
        type=int,
        help="sequences a schedule worker pulls beyond its engines' room, so that tenants "
        "take turns in its waiting line (64; 0: pull only what fits)",
    )
    g.add_argument(
        "--batch-headroom",
        type=float,
        help="share of each engine's sequences and KV tokens a batch job's requests leave free "
        "for interactive ones (0.125)",
    )
    g.add_argument(
        "--batch-busy-share",
        type=float,
        help="share of each engine a batch job's requests may take while a schedule worker "
        "runs interactive ones, and for a second after (0.25)",
    )
    g.add_argument(
        "--decode-reserve",
        type=int,
        help="engine tokens a sequence holds ahead of its output, charged again as it outgrows "
        "them up to its max_tokens (1024): what flow control charges instead of max_tokens",
    )
    g.add_argument(
        "--engine-wait",
        type=float,
        help="seconds a request waits for an engine of its model to register before a 503 (10)",
    )
    g.add_argument(
        "--owner-ack-wait",
        type=float,
        help="seconds after a schedule worker's last progress ack that its requests move to "
        "another worker (2)",
    )
    g.add_argument(
        "--relay-attempts",
        type=int,
        help="times a request continues on another engine after one fails it (3)",
    )
    g.add_argument(
        "--stream-interval",
        type=int,
        help="tokens a streamed chunk carries at least, as vLLM's (1); a request's "
        "stream_interval may raise it; a stream's first and last chunks go at once",
    )
    g.add_argument("--queue-max-msgs", type=int, help="queued requests per stage (10000)")
    g.add_argument(
        "--max-fanout", type=int, help="multi-prompt requests one schedule worker owns (64)"
    )
    g.add_argument(
        "--fanout-buffer",
        type=int,
        help="output events held per prompt until every prompt's stream has begun (1024)",
    )
    g.add_argument(
        "--fanout-retries",
        type=int,
        help="whole-request retries of a multi-prompt request failing before output (1)",
    )
    g.add_argument(
        "--share-prefix-cache",
        action="store_true",
        default=None,
        help="tenants (API keys, direct clients) share the engines' prefix caches: for tenants "
        "that trust each other (default: each tenant's prompts are salted apart, so that no "
        "tenant can time another's cached prompt)",
    )
    g.add_argument(
        "--trust-client-kv-transfer",
        action="store_true",
        default=None,
        help="pass a tenant's kv_transfer_params on to the engines, for clients that are "
        "trusted P/D coordinators (default: a 400, since they name KV blocks that may hold "
        "another tenant's prompt; without API keys they are always passed on)",
    )


def parsers(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output parsing (as `vllm serve` names it)")
    g.add_argument(
        "--reasoning-parser",
        help="deepseek_r1, deepseek_v3, qwen3, glm45, glm47, kimi_k2, minimax_m2, "
        "minimax_m2_append_think, mistral, seed_oss or openai_gptoss (bundled model: "
        "deepseek_v3; a model directory: what its chat template speaks, gpt-oss's harmony "
        "where its config says gpt_oss)",
    )
    g.add_argument(
        "--tool-call-parser",
        help="deepseek_v31, deepseek_v32, deepseek_v4, glm45, glm47, hermes, kimi_k2, "
        "llama3_json, llama4_json, llama4_pythonic, minimax_m2, mistral, openai, pythonic, "
        "qwen3_coder, qwen3_xml or seed_oss (bundled model: deepseek_v31; a model directory: "
        "what its chat template speaks, or openai for gpt-oss)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        default=None,
        help='parse tool calls for tool_choice "auto" (bundled model: on)',
    )
    g.add_argument(
        "--strict-tool-calling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="constrain tool calls to the tool parser's own syntax with a structural tag, as "
        "vLLM does by default (on); off: a forced call to the tools' JSON schema, as vLLM "
        "with VLLM_ENFORCE_STRICT_TOOL_CALLING=0",
    )
    g.add_argument(
        "--tool-strict-level",
        choices=["auto", "function", "parameter"],
        help="as vLLM's: auto (default) constrains calls where tool_choice forces one or a "
        "tool is strict; function also every auto call's envelope; parameter also every "
        "tool's arguments to its schema",
    )


def render(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("render backend")
    g.add_argument(
        "--render-backend",
        choices=["local", "vllm"],
        help="local: the model directory's tokenizer (default); vllm: a vLLM render server at "
        "--render-url, falling back to the local tokenizer when it fails",
    )
    g.add_argument("--render-url", help="http://host:port of the vLLM render server")
    g.add_argument(
        "--render-connect-timeout", type=float, help="seconds to connect to it (default 2)"
    )
    g.add_argument("--render-timeout", type=float, help="seconds for its whole reply (default 10)")


def render_placement(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--render-placement",
        choices=["ingress", "pool"],
        help="ingress: the ingress process renders and tokenizes its requests and queues them "
        "for an owner itself (one stored hop less); pool: it queues them for the render "
        f"workers (`tokenway render`), which scale apart (default {default}). Render workers "
        "take what is published on tw.render.* either way",
    )


def limits(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "request limits (ingress and render: past one, a 400 before anything is templated, "
        "tokenized or compiled)"
    )
    g.add_argument(
        "--max-tools",
        type=int,
        help="tools one request may give (1024; OpenAI takes 128)",
    )
    g.add_argument(
        "--max-schema-bytes",
        type=int,
        help="bytes of JSON text in all of a request's schemas together: tools' parameters, "
        "response_format, structured_outputs (1048576); checked before the body is decoded",
    )
    g.add_argument(
        "--max-schema-nodes",
        type=int,
        help="JSON values (objects, arrays, scalars) in all of a request's schemas together, "
        "a structural tag's too (65536)",
    )
    g.add_argument(
        "--max-grammar-bytes",
        type=int,
        help="bytes of a request's regexes, grammars and choices, with its schemas' patterns "
        "(65536)",
    )


def derender(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("derender (render needs the backend too: it adds the client body)")
    g.add_argument(
        "--derender-placement",
        choices=["owner", "pool"],
        help="owner: each schedule worker derenders its own requests in process (default); "
        "pool: it calls the derender workers (`tokenway derender`) over the bus",
    )
    g.add_argument(
        "--derender-backend",
        choices=["local", "vllm"],
        help="local: the model directory's tokenizer (default); vllm: a vLLM derender server "
        "at --derender-url, with no local fallback",
    )
    g.add_argument(
        "--derender-url", help="http://host:port of it (default: --render-url, TOKENWAY_RENDER_URL)"
    )
    g.add_argument(
        "--derender-connect-timeout", type=float, help="seconds to connect to it (default 2)"
    )
    g.add_argument(
        "--derender-server-timeout",
        type=float,
        help="seconds for its whole reply (default 5; must be below TOKENWAY_DERENDER_TIMEOUT, 10)",
    )


def http(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8000; 0 picks a free one)")
    p.add_argument("--ingress-id", help="this ingress's id on the bus (default: random)")
    p.add_argument(
        "--access-log",
        action="store_true",
        default=None,
        help="log a line per HTTP response on stdout (client, method, path, status)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        help="a request body above this is refused with a 413 before it is read (8000000)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        help="seconds a client has to send its whole request body; later, a 408 (30)",
    )
    p.add_argument(
        "--max-body-rate",
        type=int,
        help="bytes a second of request bodies one client (tenant, or address without keys) "
        "may send; faster, its next body waits unread (33554432; 0: no bound)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        help="seconds a client has to send a request's whole head (request line and headers) "
        "from its first byte, or from connecting; later, a 408 and the connection closed (10)",
    )
    p.add_argument(
        "--max-header-bytes",
        type=int,
        help="bytes a request's head (request line and headers) may have; past them, a 431 "
        "and the connection closed (65536)",
    )
    p.add_argument(
        "--max-connections-per-address",
        type=int,
        help="connections one client address may hold open at once; past them, a 429 and the "
        "connection closed (1024: room for a load generator or a proxy; 0: no cap)",
    )
    p.add_argument(
        "--stream-buffer-bytes",
        type=int,
        help="output bytes held for a stream whose client reads slowly; the rest is read back "
        "from TW_OUT as it catches up (1048576)",
    )
    g = p.add_argument_group("API keys (none given: the API is open)")
    g.add_argument(
        "--api-key",
        action="append",
        help="a key clients send as `Authorization: Bearer KEY` (repeatable; tenant "
        "`default`); prefer TOKENWAY_API_KEY (comma-separated) or --api-key-file",
    )
    g.add_argument(
        "--api-key-file",
        help="keys of several tenants, `TENANT KEY [concurrent=N] [tokens_per_minute=N] "
        "[files_bytes=N] [files_count=N] [responses_bytes=N] [responses_count=N]` per line "
        "(# comments); a tenant's limits are shared by all its keys and every ingress",
    )
    g.add_argument(
        "--tenant-concurrency",
        type=int,
        help="requests a tenant may run at once where its key file sets no limit (default 0: "
        "no limit); past it, a 429 with Retry-After",
    )
    g.add_argument(
        "--tenant-tokens-per-minute",
        type=int,
        help="tokens (prompt + max_tokens × n; no max_tokens: the context left) a tenant may "
        "start per minute where its key file sets no limit (default 0: no limit)",
    )
    g.add_argument(
        "--tenant-files-bytes",
        type=int,
        help="bytes of files (uploads, batch outputs) a tenant may keep where its key file "
        "sets none (1073741824, a quarter of the files store; 0: no limit); past it, a 400",
    )
    g.add_argument(
        "--tenant-files-count",
        type=int,
        help="files a tenant may keep, a running batch's parts among them (10000)",
    )
    g.add_argument(
        "--tenant-responses-bytes",
        type=int,
        help="bytes of stored responses a tenant may keep (268435456, a quarter of the "
        "store; each leaves at TOKENWAY_RESPONSES_MAX_AGE); past it, `store: true` is a 400",
    )
    g.add_argument(
        "--tenant-responses-count", type=int, help="stored responses a tenant may keep (100000)"
    )
    g.add_argument(
        "--open-routes",
        help="routes served without a key besides /health: ready, metrics, both (default) or none",
    )
    g = p.add_argument_group("CORS (no origin given: browsers get no cross-origin access)")
    g.add_argument(
        "--allowed-origins",
        action="append",
        help="an origin browsers may call from, `https://app.example` or `*` (repeatable; a "
        "JSON list or comma-separated also works)",
    )
    g.add_argument("--allowed-methods", help="methods they may use (default `*`)")
    g.add_argument("--allowed-headers", help="request headers they may send (default `*`)")
    g.add_argument(
        "--allow-credentials",
        action="store_true",
        default=None,
        help="let them send cookies and HTTP auth too (not with origin `*`)",
    )


def sim(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulated engine")
    g.add_argument(
        "--sim-engines",
        type=int,
        help="how many simulated engines per model (default 1; `up` with --vllm-url: 0, none)",
    )
    g.add_argument("--sim-max-seqs", type=int, help="concurrent sequences per engine (default 256)")
    g.add_argument("--sim-chunk-size", type=int, help="tokens per sequence per step (default 1)")
    g.add_argument("--sim-ttft", type=float, help="seconds to first token (default 0.02)")
    g.add_argument("--sim-itl", type=float, help="seconds per token (default 0.01)")
    g.add_argument("--sim-output-len", type=int, help="mean output length before EOS (default 200)")
    g.add_argument(
        "--sim-roles", help="roles of the simulated engines, e.g. prefill,decode (default union)"
    )
    g.add_argument(
        "--sim-tool-calls",
        action="store_true",
        default=None,
        help="the simulated model calls a tool where the prompt's last turn is a user's (the "
        "tool the turn names, else the first; made-up arguments of its schema) and answers a "
        "tool's output in text, so an agent client's tool loop runs (off: free text wherever "
        "it is allowed); it knows the tools only from the request's constraint, which under "
        "tool_choice auto takes --tool-strict-level function",
    )


def vllm(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM engine")
    g.add_argument(
        "--vllm-url",
        action="append",
        metavar="[MODEL=]URL",
        help="http://host:port of a vLLM server (repeatable); MODEL= names the served model "
        "it runs where there are several",
    )
    g.add_argument("--engine-id", help="id in the registry (default: vllm-<host>-<port>)")
    g.add_argument("--engine-role", choices=["union", "prefill", "decode"], help="default union")
    g.add_argument("--engine-max-seqs", type=int, help="concurrent sequences (default 256)")
    g.add_argument("--engine-connect-timeout", type=float, help="seconds (default 5)")
    g.add_argument(
        "--engine-first-token-timeout", type=float, help="seconds to first token (default 600)"
    )
    g.add_argument("--engine-token-timeout", type=float, help="seconds between tokens (default 60)")


def obfuscation(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "token obfuscation (the same key on every schedule and engine stage; see docs/engines.md)"
    )
    g.add_argument(
        "--obfuscation-key",
        help="secret key (16+ bytes) permuting token IDs between schedulers and engines; "
        "prefer TOKENWAY_OBFUSCATION_KEY or --obfuscation-key-file over this flag",
    )
    g.add_argument(
        "--obfuscation-key-file", help="read the key from this file (surrounding blanks dropped)"
    )
