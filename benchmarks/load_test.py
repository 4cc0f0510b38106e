"""A bounded load test of `medusa-heads serve` on loopback, with speculation on and off.

    python benchmarks/load_test.py [--clients 24] [--max-tokens 24] [--threads 1] [--dtype bfloat16] \
        [--config NAME="SERVER ARGS" ...] [--out load.json]

For each configuration (by default `speculative`, the default drafter and tree, and `plain`, `--drafter dynamic
--budget 0`: the same loop drafting nothing) it starts a server on a free port, sends one warm-up request, then
has `--clients` clients send one streamed greedy chat request each, all at once (a prompt of
benchmarks/prompts.jsonl each), and stops the server. It reports throughput, latency and time to first token
(p50/p95, measured by the clients), tokens per verification step and the mean batch size (from /metrics). Greedy
decoding is lossless, so in float32 every answer must be the same under every configuration: a lost, failed or
mixed-up response fails the run. In a lower precision a batched or tree forward rounds differently from a
single-token one, so answers may drift apart after a near tie: they are counted, not failed on.
"""

import argparse
import json
import math
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
SERVER = Path(sys.executable).parent / "medusa-heads"
CONFIGS = ["speculative=", "plain=--drafter dynamic --budget 0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(server_args: list[str], log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([str(SERVER), "serve", "--port", str(port), *server_args], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    for _ in range(360):
        if proc.poll() is not None:
            sys.exit(f"the server stopped: see {log.name}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"the server did not start: see {log.name}")


def ask(url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy chat request, timed by the client."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start, first, pieces, tokens = time.perf_counter(), None, [], 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        if response.status_code != 200:
            return {"error": f"{response.status_code}: {response.read().decode()}"}
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and (text := chunk["choices"][0]["delta"].get("content")):
                first = first or time.perf_counter()
                pieces.append(text)
    end = time.perf_counter()
    return {"text": "".join(pieces), "tokens": tokens, "latency": end - start, "ttft": (first or end) - start}


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def run(name: str, server_args: list[str], prompts: list[str], max_tokens: int) -> dict:
    with tempfile.NamedTemporaryFile("w", prefix=f"serve-{name}-", suffix=".log", delete=False) as log:
        proc, url = start_server(server_args, log)
    try:
        ask(url, "Hello!", 8)  # warm-up, not counted
        before = counters(url)
        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: ask(url, p, max_tokens), prompts))
        wall = time.perf_counter() - start
        after = counters(url)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    ok = [r for r in results if "error" not in r]
    batches = after["medusa_batch_size_count"] - before["medusa_batch_size_count"]
    steps = after["medusa_speculative_verification_steps_total"] - before["medusa_speculative_verification_steps_total"]
    accepted = after["medusa_speculative_accepted_tokens_total"] - before["medusa_speculative_accepted_tokens_total"]
    tokens = sum(r["tokens"] for r in ok)
    latencies, ttfts = [r["latency"] for r in ok], [r["ttft"] for r in ok]
    return {
        "config": name, "server_args": server_args, "requests": len(prompts), "errors": len(prompts) - len(ok),
        "completion_tokens": tokens, "wall_seconds": wall, "tokens_per_second": tokens / wall,
        "requests_per_second": len(ok) / wall, "latency_p50": percentile(latencies, 0.5),
        "latency_p95": percentile(latencies, 0.95), "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p95": percentile(ttfts, 0.95), "tokens_per_step": (accepted + steps) / max(steps, 1),
        "mean_batch": (after["medusa_batch_size_sum"] - before["medusa_batch_size_sum"]) / max(batches, 1),
        "texts": [r.get("text") for r in results], "error_messages": [r["error"] for r in results if "error" in r],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=24, help="concurrent clients, one request each")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    parser.add_argument("--dtype", default="float32", help="the servers' dtype")
    parser.add_argument("--config", action="append", metavar='NAME="SERVER ARGS"',
                        help=f"a server configuration (repeatable; default: {CONFIGS})")
    parser.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "prompts.jsonl")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [rows[i % len(rows)]["prompt"] for i in range(args.clients)]
    results = []
    for config in args.config or CONFIGS:
        name, _, server_args = config.partition("=")
        server = shlex.split(server_args) + ["--threads", str(args.threads), "--max-queue", str(args.clients),
                                             "--dtype", args.dtype]
        results.append(run(name, server, prompts, args.max_tokens))
        print(f"{name}: done in {results[-1]['wall_seconds']:.1f} s", file=sys.stderr)
    print("| config | server args | requests | errors | tokens/s | requests/s | latency p50 / p95 (s) | "
          "TTFT p50 / p95 (s) | tokens per step | mean batch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['config']} | `{' '.join(r['server_args'])}` | {r['requests']} | {r['errors']} | "
              f"{r['tokens_per_second']:.1f} | {r['requests_per_second']:.2f} | {r['latency_p50']:.1f} / "
              f"{r['latency_p95']:.1f} | {r['ttft_p50']:.1f} / {r['ttft_p95']:.1f} | {r['tokens_per_step']:.2f} | "
              f"{r['mean_batch']:.1f} |")
    differing = sum(len({r["texts"][i] for r in results}) > 1 for i in range(len(prompts)))
    print(f"\nanswers that differ between configurations: {differing} of {len(prompts)}")
    lost = differing > 0 and args.dtype == "float32"  # lossless there: a differing answer is a mixed-up one
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    failures = [m for r in results for m in r["error_messages"]]
    if failures or lost or not all(results[0]["texts"]):
        sys.exit(f"load test failed: {len(failures)} errors {failures[:3]}, {differing} differing answers")


if __name__ == "__main__":
    main()
