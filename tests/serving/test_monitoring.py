"""Monitoring checked for real: a Prometheus (Debian's, which `scripts/install-test-tools.sh` fetches) scrapes Ray's
metrics endpoint while the served application answers traffic, and through Prometheus's HTTP API every panel query
of deploy/grafana_dashboard.json returns data, every pagedserve series labelled with its model and replica."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.serving.app import GRPC, METRICS_PORT, free_port

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = REPO / ".tools" / "prometheus" / "usr" / "bin" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana_dashboard.json"


def prometheus_binary() -> str | None:
    return str(PROMETHEUS) if PROMETHEUS.exists() else shutil.which("prometheus")


@pytest.fixture(scope="module")
def prometheus(app, tmp_path_factory):
    """A Prometheus on loopback scraping Ray's metrics endpoint every second: its address."""
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("no Prometheus: scripts/install-test-tools.sh fetches Debian's")
    home = tmp_path_factory.mktemp("prometheus")
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": [f"127.0.0.1:{METRICS_PORT}"]}]}]}
    (home / "prometheus.yml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{free_port()}"
    with open(home / "log", "w") as log:
        proc = subprocess.Popen([binary, f"--config.file={home / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={home / 'data'}", f"--web.listen-address={url[7:]}"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if urllib.request.urlopen(f"{url}/-/ready", timeout=5).status == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (home / "log").read_text()[-3000:]
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def api(url: str, path: str, **params: str):
    """A Prometheus HTTP API call's `data`."""
    query = urllib.parse.urlencode(params)
    body = json.loads(urllib.request.urlopen(f"{url}/api/v1/{path}?{query}", timeout=30).read())
    assert body["status"] == "success", body
    return body["data"]


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, query) of every target of every panel, the `$model` variable set to all models."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"].replace("$model", ".+")) for panel in dashboard["panels"]
            for target in panel.get("targets", [])]


def has_data(result: list[dict]) -> bool:
    """Whether a query's result holds a number (a ratio or quantile of nothing is NaN: no data)."""
    return any(math.isfinite(float(series["value"][1])) for series in result)


async def crowd(app: str) -> None:
    """More requests than the application's 24-block pool holds at once (preemptions), sharing a prompt prefix
    (prefix-cache hits), ending by length and by a stop string."""
    from pagedserve.client import AsyncClient

    prompt = " ".join(f"word{i}" for i in range(40))
    async with AsyncClient(GRPC, application=app, timeout=300) as c:
        await asyncio.gather(*(c.generate(f"{i} {prompt}", max_tokens=40, ignore_eos=True) for i in range(12)),
                             c.generate(prompt, max_tokens=40, stop=[" "]))


def test_every_dashboard_panel_finds_its_metrics_in_prometheus(app, prometheus):
    queries = panel_queries()
    assert len(queries) >= 16
    deadline = time.monotonic() + 180  # Ray exports on an interval; a rate needs two scrapes that saw it move
    while True:
        asyncio.run(crowd(app))
        empty = [(title, expr) for title, expr in queries
                 if not has_data(api(prometheus, "query", query=expr)["result"])]
        if not empty or time.monotonic() > deadline:
            break
    assert not empty, f"panel queries without data: {empty}"
    series = api(prometheus, "series", **{"match[]": '{__name__=~"ray_pagedserve_.+"}'})
    assert series
    # every application's replicas export them (this package serves several): each series names its own
    unlabelled = sorted({s["__name__"] for s in series if not (s.get("model") and s.get("replica")
                                                               and s.get("deployment") and s.get("application"))})
    assert not unlabelled, f"series without their model, replica, deployment and application: {unlabelled}"
    assert app in {s["application"] for s in series}
