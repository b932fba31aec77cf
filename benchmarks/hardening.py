"""What bad clients cost the good ones: a real `tandem serve` (the bundled model) on
127.0.0.1, a well-behaved client streaming beside each attack from the hardening
issue, against the same stream with no attack in the same run (the yardstick).

    metrics flood    3,000 GET /metrics from 16 threads while a stream runs: the
                     stream's worst and median inter-token gap (and the same flood of
                     GET /health, which renders nothing: what the requests themselves
                     cost on the shared cores)
    big bodies       4 clients posting 20 MB bodies at once: how fast each is refused
                     and the /health latency meanwhile
    tokenize         three 7.5 MB /tokenize calls: resident memory before and after
    half-open        300 connections that never finish their headers: how many are
                     still open after the header timeout, and /health meanwhile

Every attack stops by itself and targets only 127.0.0.1.

    python -m benchmarks.hardening [--repeats 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import socket
import statistics
import time

import httpx

from benchmarks.common import machine
from tandem.server.launch import tandem_server
from tandem.server.limits import ServerLimits

STREAM = {"model": "stdlib-lm", "prompt": "import os", "max_tokens": 64, "temperature": 0,
          "ignore_eos": True, "stream": True}  # fmt: skip


def stream_gaps(url: str) -> list[float]:
    """Seconds between the stream's consecutive token chunks."""
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json=STREAM, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(times)]


def status(url: str) -> int | str:
    try:
        return httpx.get(url, timeout=60).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


def flood(url: str, path: str, repeats: int) -> dict:
    worst, median, flooded_worst, flooded_median, failed = [], [], [], [], 0
    for _ in range(repeats):
        gaps = stream_gaps(url)
        worst.append(max(gaps))
        median.append(statistics.median(gaps))
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            scrapes = [pool.submit(status, f"{url}{path}") for _ in range(3000)]
            gaps = stream_gaps(url)
            failed += sum(f.result() != 200 for f in scrapes)
        flooded_worst.append(max(gaps))
        flooded_median.append(statistics.median(gaps))
    ms = lambda xs: round(statistics.median(xs) * 1e3, 1)  # noqa: E731
    return {
        "worst gap ms, alone": ms(worst), "worst gap ms, flooded": ms(flooded_worst),
        "median gap ms, alone": ms(median), "median gap ms, flooded": ms(flooded_median),
        "flood requests not answered 200": failed,
    }  # fmt: skip


def big_bodies(url: str) -> dict:
    body = b'{"prompt": "' + b"x" * (20 << 20) + b'", "max_tokens": 1}'
    headers = {"content-type": "application/json"}

    def post():
        start = time.perf_counter()
        try:
            status = httpx.post(f"{url}/v1/completions", content=body, headers=headers,
                                timeout=120).status_code  # fmt: skip
        except httpx.HTTPError:  # refused before the whole body was read
            status = "closed"
        return status, time.perf_counter() - start

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        posts = [pool.submit(post) for _ in range(4)]
        health = []
        while not all(f.done() for f in posts):
            start = time.perf_counter()
            httpx.get(f"{url}/health", timeout=120)
            health.append(time.perf_counter() - start)
        results = [f.result() for f in posts]
    return {"statuses": sorted({str(s) for s, _ in results}),
            "slowest refusal s": round(max(t for _, t in results), 2),
            "worst /health ms meanwhile": round(max(health or [0]) * 1e3, 1)}  # fmt: skip


def rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    return 0


def tokenize_memory(url: str, pid: int) -> dict:
    before = rss_mb(pid)
    text = "import os\nprint(os.path.join('a', 'b'))\n" * (7_500_000 // 40)
    for _ in range(3):
        httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=300).raise_for_status()
    time.sleep(1)
    return {"RSS MB before": before, "RSS MB after 3 x 7.5 MB /tokenize": rss_mb(pid)}


def half_open(url: str, header_timeout: float) -> dict:
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(300):
        sock = socket.create_connection((host, int(port)), timeout=5)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(sock)
    start = time.perf_counter()
    httpx.get(f"{url}/health", timeout=30).raise_for_status()
    health_ms = (time.perf_counter() - start) * 1e3
    time.sleep(header_timeout + 2)
    still_open = 0
    for sock in socks:
        sock.settimeout(0.01)
        try:
            still_open += sock.recv(1) != b""
        except TimeoutError:
            still_open += 1
        except OSError:
            pass
        sock.close()
    return {"connections": 300, f"still open after {header_timeout + 2:g} s": still_open,
            "/health ms meanwhile": round(health_ms, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(machine())
    with tandem_server("serve", "--model", "stdlib-lm", "--log-level", "warning") as server:
        print("metrics flood:", flood(server.url, "/metrics", args.repeats))
        print("health flood:", flood(server.url, "/health", args.repeats))
        print("big bodies:", big_bodies(server.url))
        print("tokenize:", tokenize_memory(server.url, server.process.pid))
        print("half-open:", half_open(server.url, ServerLimits().header_timeout))


if __name__ == "__main__":
    main()
