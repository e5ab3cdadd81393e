"""`/metrics`: the project's series (`ray_dsv41_*`) scraped from every live node's Ray metrics agent,
in Prometheus text format. Ray's own dashboards read the same series from the same agents."""

from __future__ import annotations

import asyncio

import httpx
import ray

PREFIX = "ray_dsv41_"


def _agent_urls() -> list[str]:
    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
            for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort")]


def keep_project_series(text: str) -> list[str]:
    """The sample lines and HELP/TYPE lines of series named PREFIX*."""
    out = []
    for line in text.splitlines():
        name = line.split(" ", 3)[2] if line.startswith("# ") and line.count(" ") >= 2 else line.split("{", 1)[0].split(" ", 1)[0]
        if name.startswith(PREFIX):
            out.append(line)
    return out


async def scrape_project_metrics(client: httpx.AsyncClient) -> str:
    urls = await asyncio.get_running_loop().run_in_executor(None, _agent_urls)
    replies = await asyncio.gather(*(client.get(u) for u in urls), return_exceptions=True)
    lines, seen = [], set()
    for r in replies:
        if isinstance(r, BaseException) or r.status_code != 200:
            continue
        for line in keep_project_series(r.text):
            if not (line.startswith("# ") and line in seen):  # HELP/TYPE once across nodes
                seen.add(line)
                lines.append(line)
    return "\n".join(lines) + "\n"
