"""Load and abuse against a real `specdec serve` process, for RELIABILITY.md.

    python benchmarks/server_load.py --target smollm2-135m-instruct --ngram 3 --out benchmarks/results/load.json

Three phases on one server (bound queue --max-waiting):
  sustained  C clients for D seconds, each sending its next request when the last ends (half
             streaming, 16-64 tokens): status counts, latency p50/p99, streams without [DONE]
  burst      N requests at once: 200s and 429s (with Retry-After), anything else is a loss
  abuse      every malformed request of tests/test_server_limits.py, each twice on one kept-alive
             connection: any 5xx or reset counts
and the server's RSS before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


async def one(c: httpx.AsyncClient, model: str, rng: random.Random) -> tuple[int, float, bool]:
    """(status, seconds, a stream that ended without [DONE])"""
    body = {"model": model, "messages": [{"role": "user", "content": f"Tell me about topic {rng.randint(0, 99)}."}],
            "max_tokens": rng.randint(16, 64), "temperature": 0}
    t0 = time.perf_counter()
    if rng.random() < 0.5:
        async with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            lines = [ln async for ln in r.aiter_lines() if ln]
            cut = r.status_code == 200 and (not lines or lines[-1] != "data: [DONE]")
            return r.status_code, time.perf_counter() - t0, cut
    r = await c.post("/v1/chat/completions", json=body)
    return r.status_code, time.perf_counter() - t0, False


async def sustained(url: str, model: str, clients: int, seconds: float) -> dict:
    results, end = [], time.perf_counter() + seconds

    async def client(i):
        rng = random.Random(i)
        async with httpx.AsyncClient(base_url=url, timeout=600) as c:
            while time.perf_counter() < end:
                results.append(await one(c, model, rng))

    await asyncio.gather(*(client(i) for i in range(clients)))
    ok = [s for code, s, _ in results if code == 200]
    return {"clients": clients, "seconds": seconds, "requests": len(results),
            "status": {str(k): sum(1 for r in results if r[0] == k) for k in sorted({r[0] for r in results})},
            "streams_without_done": sum(r[2] for r in results), "p50_s": pct(ok, 0.5), "p99_s": pct(ok, 0.99)}


async def burst(url: str, model: str, n: int) -> dict:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        body = {"model": model, "prompt": "burst", "max_tokens": 8, "temperature": 0}
        replies = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(n)),
                                       return_exceptions=True)
    codes = [r.status_code if isinstance(r, httpx.Response) else type(r).__name__ for r in replies]
    return {"requests": n, "status": {str(k): codes.count(k) for k in sorted(set(codes), key=str)},
            "retry_after_present": all("Retry-After" in r.headers for r in replies
                                       if isinstance(r, httpx.Response) and r.status_code == 429)}


def abuse(url: str, model: str) -> dict:
    import importlib.util

    # The malformed requests are the regression tests' own, read from their file.
    spec = importlib.util.spec_from_file_location(
        "server_limit_cases", Path(__file__).resolve().parents[1] / "tests" / "test_server_limits.py")
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    BAD = cases.BAD

    out = {"cases": len(BAD), "sent": 0, "status": {}, "5xx_or_reset": 0}
    with httpx.Client(base_url=url, timeout=120) as c:
        for path, body in BAD.values():
            body = body.replace('"tiny"', json.dumps(model))
            for _ in range(2):
                out["sent"] += 1
                try:
                    r = c.post(path, content=body.encode("utf-8", "surrogatepass"),
                               headers={"Content-Type": "application/json"})
                    out["status"][str(r.status_code)] = out["status"].get(str(r.status_code), 0) + 1
                    out["5xx_or_reset"] += r.status_code >= 500
                except httpx.TransportError:
                    out["5xx_or_reset"] += 1
    return out


def main() -> int:
    from specdec.server.launch import ServerProcess

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--ngram", type=int, default=3)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--burst", type=int, default=300)
    p.add_argument("--max-waiting", type=int, default=16)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    args = ["--target", a.target, "--ngram", str(a.ngram), "--max-waiting", str(a.max_waiting),
            "--served-model-name", "m"]
    with ServerProcess(args) as srv:
        before = rss_mb(srv.proc.pid)
        result = {"command": " ".join(sys.argv), "server_args": args, "rss_mb_before": before,
                  "abuse": abuse(srv.url, "m"),
                  "sustained": asyncio.run(sustained(srv.url, "m", a.clients, a.seconds)),
                  "burst": asyncio.run(burst(srv.url, "m", a.burst))}
        result["rss_mb_after"] = rss_mb(srv.proc.pid)
        waiting = [ln for ln in httpx.get(srv.url + "/metrics").text.splitlines()
                   if ln.startswith("vllm:num_requests_waiting{")]
        result["waiting_after"] = float(waiting[0].rsplit(" ", 1)[1]) if waiting else None
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
