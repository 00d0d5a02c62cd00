"""Throughput and tail latency of the verifier service over loopback HTTP.

Run: ``.venv/bin/python benchmarks/bench_verifier.py [--seconds 10] [--clients 8] [--server-threads 4]``

Three processes: the benchmark (this one) starts ``python -m pipeline.verifier
serve --port 0`` as a subprocess, then a *second* subprocess (this file with
``--client``) drives it with ``--clients`` threads, each holding one keep-alive
``http.client`` connection, for ``--seconds`` seconds, loopback only. Separate
processes keep the load generator's GIL out of the server's. The client
reports every latency; this process prints requests/s, p50/p99 latency, and
the ratio to in-process throughput of :func:`pipeline.verifier.verify_request`
called in a loop (same request bodies), i.e. what HTTP + waitress cost.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PATH = "/v1/task-evaluations/verify"


def _bodies() -> list[bytes]:
    """Two representative requests: a JSON field match and an exact-text mismatch."""
    base = {
        "case_id": "bench-1",
        "response_text": json.dumps({"answer": {"value": 42, "unit": "s"}, "notes": "x" * 200}),
        "evidence_artifact_ref": "cases/bench/case.json@sha256:" + "0" * 64,
        "latency_micros": 1500,
        "verification": {"mode": "JSON_FIELD_EQUALS", "field_path": "/answer/value", "expected_text": "42", "minimum_quality_millis": 900},
    }
    other = dict(base, response_text="the answer is 41", verification={"mode": "EXACT_TEXT", "expected_text": "the answer is 42", "minimum_quality_millis": 900})
    return [json.dumps(base).encode(), json.dumps(other).encode()]


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


# --------------------------------------------------------------------------- client process


def run_client(port: int, clients: int, seconds: float) -> dict:
    bodies = _bodies()
    deadline = time.perf_counter() + seconds
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors = [0] * clients

    def worker(slot: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        i = slot
        try:
            while time.perf_counter() < deadline:
                body = bodies[i % len(bodies)]
                i += 1
                start = time.perf_counter()
                conn.request("POST", PATH, body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                latencies[slot].append(time.perf_counter() - start)
                if resp.status != 200:
                    errors[slot] += 1
        finally:
            conn.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    flat = [value for per in latencies for value in per]
    return {
        "requests": len(flat),
        "errors": sum(errors),
        "elapsed": elapsed,
        "p50_ms": _percentile(flat, 0.50) * 1000,
        "p99_ms": _percentile(flat, 0.99) * 1000,
        "max_ms": max(flat) * 1000,
    }


# --------------------------------------------------------------------------- orchestration


def in_process_rate(seconds: float) -> float:
    from pipeline.verifier import verify_request

    bodies = _bodies()
    for body in bodies:  # warm up (validator construction, imports)
        verify_request(body)
    count = 0
    deadline = time.perf_counter() + seconds
    started = time.perf_counter()
    while time.perf_counter() < deadline:
        for body in bodies:
            verify_request(body)
        count += len(bodies)
    return count / (time.perf_counter() - started)


def _start_server(threads: int):
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.verifier", "serve", "--host", "127.0.0.1", "--port", "0", "--threads", str(threads)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        # Byte-code caching on, as on a normal install (see bench_build).
        env={**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "PYTHONPATH": str(REPO)},
    )
    line = proc.stderr.readline().decode()
    match = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
    if not match:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    # keep draining stderr so the server can never block on a full pipe
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, int(match.group(1))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--server-threads", type=int, default=4)
    parser.add_argument("--client", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        print(json.dumps(run_client(args.client, args.clients, args.seconds)))
        return 0

    proc, port = _start_server(args.server_threads)
    try:
        client = subprocess.run(
            [sys.executable, __file__, "--client", str(port), "--clients", str(args.clients), "--seconds", str(args.seconds)],
            capture_output=True,
            timeout=args.seconds + 60,
            check=True,
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        server_exit = proc.wait(15)
    load = json.loads(client.stdout)
    local = in_process_rate(min(args.seconds, 3.0))
    rate = load["requests"] / load["elapsed"]
    print(f"server: waitress, {args.server_threads} worker threads; load: {args.clients} keep-alive client threads in a separate process, {load['elapsed']:.1f} s, loopback")
    print(f"HTTP requests:          {load['requests']} ({load['errors']} non-200)")
    print(f"HTTP throughput:        {rate:,.0f} req/s")
    print(f"HTTP latency:           p50 {load['p50_ms']:.2f} ms, p99 {load['p99_ms']:.2f} ms, max {load['max_ms']:.2f} ms")
    print(f"in-process throughput:  {local:,.0f} verify_request/s (one thread)")
    print(f"HTTP / in-process:      {rate / local:.2f}")
    print(f"server exit status:     {server_exit}")
    return 0 if load["errors"] == 0 and server_exit == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
