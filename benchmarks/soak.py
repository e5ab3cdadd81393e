"""Soak: N minutes of mixed traffic against the embedded server, sampling the app's processes and its engine;
a table and a verdict (issue 20).

    .venv/bin/python benchmarks/soak.py [--minutes 30] [--period-s 30] [--concurrency 6] [--warmup-minutes 3]
        [--tolerance-pct 10] [--out soak.json]

Deploys the app as `python -m serve_app` does, with its defaults (the tiny random-weight checkpoint, CPU, one
replica; `--api-key` added), on a Ray of its own (4 logical CPUs) and Serve on a free port. `--concurrency`
clients loop over a weighted mix: chat and completions, streamed and not, n = 2, stop strings, logprobs, token-id
prompts, multi-turn prompts that share a prefix (prefix cache and snapshots), streams the client drops after the
first event, bad requests (each with the 4xx it must get), and a greedy probe whose text must never change.

Every --period-s it samples the resident memory and open file descriptors of each of the app's Ray processes
(by process title: engine replica, shard worker, ingress, proxy, controller; the pid too, so a restart shows),
of this driver and of all Ray's processes together, and the replica's status: running and waiting requests,
global KV blocks in use (requests + prefix-cache snapshots) and cached (evictable), window blocks in use.

Verdict: a series is flat when the mean of its last quarter of samples (after the warm-up) is within
--tolerance-pct of its first quarter's mean, or within an absolute slack (16 MiB of memory, 4 descriptors,
8 KV blocks: what half of max_num_seqs' requests hold at once); outside that it "fell" (memory handed back:
no leak) or is GROWING (a fail). `--judge soak.json` re-judges the samples of an earlier run. Also required: no 5xx, no request over its timeout, no unexpected status, the probe
identical throughout, and at the end the engine idle with its integrity check passing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local Ray; Ray 2.60 turns token auth on by default

APP = "dsv41"
MODEL = "deepseek-v4.1-flash"
API_KEY = "sk-soak"
REQUEST_TIMEOUT_S = 120.0
# process title prefix -> the name the table gives it
PROCESSES = {"ray::ServeReplica:dsv41:EngineReplica": "replica", "ray::ShardWorker": "shard",
             "ray::ServeReplica:dsv41:OpenAIIngress": "ingress", "ray::ProxyActor": "proxy",
             "ray::ServeController": "controller"}
SLACK = {"rss_mib": 16.0, "fds": 4.0, "blocks": 8.0}  # absolute slack of the flatness rule
WORDS = ("river", "engine", "token", "window", "cache", "stream", "replica", "ingress", "prefix", "block", "soak",
         "memory", "paris", "tokyo", "lima", "seven", "blue", "quiet", "north", "garden")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- processes -----------------------------------------------------------------------------------------------
def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def descendants(root: int) -> list[int]:
    tree, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += tree.get(pid, [])
    return out


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def num_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


@dataclass(slots=True)
class Sample:
    t_s: float  # since the traffic started
    procs: dict[str, dict[str, float]]  # name -> pid, rss_mib, fds
    engine: dict[str, float]  # the replica's status fields
    num_requests: int


def sample_processes() -> dict[str, dict[str, float]]:
    me = os.getpid()
    out = {"driver": {"pid": me, "rss_mib": rss_mib(me), "fds": num_fds(me)}}
    total = {"pid": 0, "rss_mib": 0.0, "fds": 0}
    for pid in descendants(me)[1:]:
        rss, fds = rss_mib(pid), num_fds(pid)
        total["rss_mib"] += rss
        total["fds"] += fds
        name = next((n for prefix, n in PROCESSES.items() if title(pid).startswith(prefix)), None)
        if name is not None:
            out[name] = {"pid": pid, "rss_mib": rss, "fds": fds}
    out["ray (all)"] = total
    return out


# ---- traffic --------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Tally:
    by_kind: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    num_429: int = 0
    probe: str | None = None


def prompt_text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def chat(content: str, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "reasoning_effort": "none",
            "max_tokens": 8, **fields}


def bad_requests(rng: random.Random) -> list[tuple[str, bytes | dict, int, dict]]:
    """(path, body, the status it must get, extra headers)"""
    return [
        ("/v1/chat/completions", b'{"model": "deepseek-v4.1-flash", "messages": [', 400, {}),
        ("/v1/chat/completions", chat("hi", temperature=5), 400, {}),
        ("/v1/chat/completions", chat("hi", model="gpt-4"), 404, {}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["a"] * 9}, 400, {}),
        ("/v1/chat/completions", b'{"model": "x", "messages": ' + b"[" * 500 + b"]" * 500 + b"}", 400, {}),
        ("/v1/chat/completions", b'{"model": "deepseek-v4.1-flash", "messages": [{"role": "user", "content": "\\ud800"}]}',
         400, {}),
        ("/v1/chat/completions", chat("hi"), 401, {"Authorization": "Bearer sk-wrong"}),
        ("/v1/chat/completions", chat("<｜end▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>"), 200, {}),
        ("/v1/completions", {"model": MODEL, "prompt": [5, 6, 10**9]}, 400, {}),
    ]


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random, tally: Tally,
                      history: list[dict]) -> None:
    if kind == "bad":
        path, body, want, headers = rng.choice(bad_requests(rng))
        if isinstance(body, bytes):
            r = await client.post(path, content=body, headers={"Content-Type": "application/json", **headers})
        else:
            r = await client.post(path, json=body, headers=headers)
        _check(tally, kind, r.status_code, want, r.text)
        return
    if kind == "probe":
        r = await client.post("/v1/chat/completions", json=chat("Name three rivers.", temperature=0))
        if _check(tally, kind, r.status_code, 200, r.text):
            text = r.json()["choices"][0]["message"]["content"]
            if tally.probe is None:
                tally.probe = text
            elif text != tally.probe:
                tally.failures.append(f"probe changed: {tally.probe!r} -> {text!r}")
        return
    if kind == "multi_turn":  # a conversation that grows: prefix-cache snapshots and hits
        if len(history) > 12 or not history:
            history.clear()
            history.append({"role": "system", "content": prompt_text(rng, 150)})
        history.append({"role": "user", "content": prompt_text(rng, 12)})
        r = await client.post("/v1/chat/completions", json={**chat(""), "messages": history, "temperature": 0.8})
        if _check(tally, kind, r.status_code, 200, r.text):
            history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        return
    path, body, stream = {
        "chat": ("/v1/chat/completions", chat(prompt_text(rng, 20), n=2, stop=[" the", "e"], seed=rng.randrange(99)), False),
        "chat_stream": ("/v1/chat/completions", chat(prompt_text(rng, 30), logprobs=True, top_logprobs=2,
                                                     stream_options={"include_usage": True}), True),
        "completion": ("/v1/completions", {"model": MODEL, "prompt": [rng.randrange(100, 60000) for _ in range(40)],
                                           "max_tokens": 6, "temperature": 0}, False),
        "completion_stream": ("/v1/completions", {"model": MODEL, "prompt": prompt_text(rng, 25), "max_tokens": 8,
                                                  "logprobs": 2, "n": 2}, True),
        "disconnect": ("/v1/chat/completions", chat(prompt_text(rng, 20), max_tokens=200), True),
    }[kind]
    if not stream:
        r = await client.post(path, json=body)
        _check(tally, kind, r.status_code, 200, r.text)
        return
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        if not _check(tally, kind, r.status_code, 200, (await r.aread()).decode() if r.status_code != 200 else ""):
            return
        done = False
        async for line in r.aiter_lines():
            if line.startswith("data: {") and kind == "disconnect":
                return  # the client goes away mid-stream: the context exit closes the connection
            if line.startswith('data: {"error"'):
                tally.failures.append(f"{kind}: error event {line[:300]}")
            done |= line == "data: [DONE]"
        if not done:
            tally.failures.append(f"{kind}: the stream ended without [DONE]")


def _check(tally: Tally, kind: str, status: int, want: int, text: str) -> bool:
    tally.statuses[status] += 1
    if status == 429 or status == 503:
        tally.num_429 += 1
        return False
    if status != want:
        tally.failures.append(f"{kind}: {status} (wanted {want}) {text[:300]}")
        return False
    return True


MIX = {"chat": 3, "chat_stream": 3, "completion": 2, "completion_stream": 2, "multi_turn": 2, "disconnect": 1,
       "bad": 2, "probe": 1}


async def client_loop(base_url: str, seed: int, deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    history: list[dict] = []
    kinds, weights = list(MIX), list(MIX.values())
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10)) as client:
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            tally.by_kind[kind] += 1
            try:
                await asyncio.wait_for(one_request(client, kind, rng, tally, history), REQUEST_TIMEOUT_S)
            except (asyncio.TimeoutError, httpx.TimeoutException):
                tally.failures.append(f"{kind}: no answer within {REQUEST_TIMEOUT_S:.0f} s")
            except httpx.HTTPError as e:
                tally.failures.append(f"{kind}: {type(e).__name__}: {e}")


# ---- the run ---------------------------------------------------------------------------------------------------
def engine_status(handle) -> dict[str, float]:
    s = handle.status.remote().result(timeout_s=30)
    return {"running": s.num_running, "waiting": s.num_waiting, "global_blocks": s.num_global_blocks,
            "global_in_use": s.num_global_blocks_in_use,
            "global_cached": s.num_global_blocks_cached, "swa_in_use": s.num_swa_blocks_in_use}


async def soak(args: argparse.Namespace, base_url: str, handle) -> tuple[list[Sample], Tally, float]:
    tally, samples = Tally(), []
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    clients = [asyncio.create_task(client_loop(base_url, 1000 + i, deadline, tally)) for i in range(args.concurrency)]
    loop = asyncio.get_running_loop()
    next_at = t0
    while time.monotonic() < deadline:
        procs = await loop.run_in_executor(None, sample_processes)
        engine = await loop.run_in_executor(None, engine_status, handle)
        samples.append(Sample(time.monotonic() - t0, procs, engine, sum(tally.by_kind.values())))
        print_sample(samples[-1], first=len(samples) == 1)
        next_at += args.period_s
        await asyncio.sleep(max(0.0, min(next_at, deadline) - time.monotonic()))
    await asyncio.gather(*clients)
    return samples, tally, time.monotonic() - t0


COLUMNS = ["replica", "shard", "ingress", "proxy", "controller", "driver", "ray (all)"]


def print_sample(s: Sample, first: bool) -> None:
    if first:
        head = "  t(s)  reqs  " + "  ".join(f"{c[:10]:>16}" for c in COLUMNS) + "   run wait  g.use g.cached swa"
        print(head + "\n" + " " * 14 + "  ".join(f"{'MiB / fds':>16}" for _ in COLUMNS), flush=True)
    cells = "  ".join(f"{s.procs[c]['rss_mib']:>9.0f} / {s.procs[c]['fds']:>4.0f}" if c in s.procs else f"{'-':>16}"
                      for c in COLUMNS)
    e = s.engine
    print(f"{s.t_s:>6.0f} {s.num_requests:>5}  {cells}   {e['running']:>3.0f} {e['waiting']:>4.0f}  {e['global_in_use']:>5.0f} "
          f"{e['global_cached']:>8.0f} {e['swa_in_use']:>3.0f}", flush=True)


def trend(values: list[float], tolerance_pct: float, slack: float) -> tuple[float, float, str]:
    """(first-quarter mean, last-quarter mean, "flat" | "fell" | "GROWING"): flat within tolerance_pct of the
    first quarter's mean or within slack; outside it, a fall (memory handed back) is no leak, a rise is."""
    q = max(1, len(values) // 4)
    first, last = statistics.fmean(values[:q]), statistics.fmean(values[-q:])
    bound = max(slack, abs(first) * tolerance_pct / 100)
    return first, last, "flat" if abs(last - first) <= bound else ("fell" if last < first else "GROWING")


def verdict(samples: list[Sample], args: argparse.Namespace) -> tuple[list[str], bool]:
    steady = [s for s in samples if s.t_s >= args.warmup_minutes * 60]
    lines, ok = [], True
    if len(steady) < 4:
        return [f"only {len(steady)} samples after the warm-up: too few to judge"], False
    lines.append(f"{'series':<28} {'first quarter':>14} {'last quarter':>13} {'change':>8}  verdict")
    series = []
    for name in COLUMNS:
        if all(name in s.procs for s in steady):
            pids = {s.procs[name]["pid"] for s in steady}
            if name != "ray (all)" and len(pids) > 1:
                lines.append(f"{name}: restarted during the soak (pids {sorted(pids)})")
                ok = False
            for key in ("rss_mib", "fds"):
                series.append((f"{name} {'MiB' if key == 'rss_mib' else 'fds'}", [s.procs[name][key] for s in steady],
                               SLACK[key]))
    series.append(("global KV blocks in use", [s.engine["global_in_use"] for s in steady], SLACK["blocks"]))
    series.append(("window KV blocks in use", [s.engine["swa_in_use"] for s in steady], SLACK["blocks"]))
    for name, values, slack in series:
        first, last, judged = trend(values, args.tolerance_pct, slack)
        ok &= judged != "GROWING"
        change = (last - first) / first * 100 if first else 0.0
        lines.append(f"{name:<28} {first:>14.1f} {last:>13.1f} {change:>7.1f}%  {judged}")
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--period-s", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--warmup-minutes", type=float, default=3.0)
    p.add_argument("--tolerance-pct", type=float, default=10.0)
    p.add_argument("--out", help="write the samples and the tally as JSON here")
    p.add_argument("--judge", metavar="JSON", help="no run: the verdict on the samples an earlier --out wrote "
                   "(with this run's --warmup-minutes and --tolerance-pct)")
    args = p.parse_args(argv)
    if args.judge:
        saved = json.loads(Path(args.judge).read_text())
        samples = [Sample(**s) for s in saved["samples"]]
        lines, no_growth = verdict(samples, args)
        print("\n".join(lines))
        ok = no_growth and not saved["failures"]
        print(f"VERDICT on {args.judge}: {'PASS' if ok else 'FAIL'} (no series growing: {no_growth}; "
              f"{len(saved['failures'])} failures recorded)")
        return 0 if ok else 1

    import ray
    from ray import serve

    from serve_app.__main__ import ensure_tiny_checkpoint
    from serve_app.app import build_app
    from serve_app.settings import ServeSettings

    port = free_port()
    settings = ServeSettings.from_cli(["--checkpoint", str(ensure_tiny_checkpoint()), "--api-key", API_KEY,
                                       "--port", str(port), "--host", "127.0.0.1", "--device", "cpu"], environ={})
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = time.monotonic()
        serve.run(build_app(settings), name=APP, route_prefix="/")
        handle = serve.get_deployment_handle("EngineReplica", APP)
        base_url = f"http://127.0.0.1:{port}"
        print(f"soak: {args.minutes:g} min, {args.concurrency} clients, samples every {args.period_s:g} s; app ready in "
              f"{time.monotonic() - t0:.0f} s at {base_url} ({settings.checkpoint}, defaults: max_num_seqs "
              f"{settings.max_num_seqs}, max_ongoing_requests {settings.max_ongoing_requests}, cache "
              f"{settings.cache_memory_bytes >> 20} MiB)", flush=True)
        samples, tally, seconds = asyncio.run(soak(args, base_url, handle))
        idle_deadline = time.monotonic() + 60
        while (status := engine_status(handle))["running"] or status["waiting"]:
            assert time.monotonic() < idle_deadline, f"the engine is not idle 60 s after the traffic: {status}"
            time.sleep(0.2)
        handle.check_integrity.remote().result(timeout_s=60)
        info = handle.shard_info.remote().result(timeout_s=30)
    finally:
        serve.shutdown()
        ray.shutdown()

    num = sum(tally.by_kind.values())
    print(f"\n{num} requests in {seconds / 60:.1f} min ({num / seconds:.2f}/s): "
          + ", ".join(f"{k} {v}" for k, v in sorted(tally.by_kind.items())))
    print("statuses: " + ", ".join(f"{k}: {v}" for k, v in sorted(tally.statuses.items()))
          + f"; 429/503 (retried by the next loop): {tally.num_429}; KV pools {info[0]['cache_bytes'] >> 20} MiB, "
          f"{status['global_blocks']:.0f} global blocks; at the end {status['global_in_use']:.0f} in use (snapshots), "
          f"{status['global_cached']:.0f} cached")
    print(f"end: engine idle, integrity check passed; probe text {tally.probe!r}")
    lines, no_growth = verdict(samples, args)
    print("\n".join(lines))
    num_5xx = sum(v for k, v in tally.statuses.items() if k >= 500 and k != 503)
    ok = no_growth and not tally.failures and num_5xx == 0
    for failure in tally.failures[:20]:
        print("failure:", failure)
    print(f"VERDICT: {'PASS' if ok else 'FAIL'} (no series growing: {no_growth}; {len(tally.failures)} failures; "
          f"{num_5xx} 5xx)")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "samples": [asdict(s) for s in samples],
                                              "by_kind": tally.by_kind, "statuses": tally.statuses,
                                              "failures": tally.failures}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
