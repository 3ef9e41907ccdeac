"""The Ray dashboard and Prometheus as a user meets them, in a real browser (Debian's chromium,
driven by Playwright): `shardserve serve --prometheus-port` prints where the dashboard is and how
to get its token; with the token `ray get-auth-token` prints, typed into the dashboard's own
dialog, its Serve page lists every shard deployment; Prometheus, running on the scrape
configuration of the server's Ray, graphs a `shardserve` series the router exported; a stop ends
Prometheus with everything else."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import numpy as np
import pytest

from index_build.job import build_index
from loadtests.served import Server, wait_for
from shardserve.runtime.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.haproxy, pytest.mark.browser]
RAY = Path(sys.executable).parent / "ray"
CHROMIUM = "/usr/bin/chromium"
# Chromium as root in a closed network: no sandbox, and none of its calls home
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
SERIES = 'ray_shardserve_request_latency_ms_count{endpoint="search"}'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, int]]:
    index = tmp_path_factory.mktemp("dashboard") / "idx"
    build_index("fashion-mnist", 2, "IVF64,Flat", str(index), limit=5000, backend="local")
    prometheus_port = free_port()
    running = Server(index, free_port(), flags=("--num-cpus", "2", "--prometheus-port", str(prometheus_port)))
    try:
        running.wait_said("Ctrl-C stops it.", 0)  # the banner, whole
        yield running, prometheus_port
    finally:
        running.stop()


def _browser(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)


def test_the_dashboard_lists_the_shards_and_prometheus_graphs_the_routers_series(
        server: tuple[Server, int]) -> None:
    from playwright.sync_api import expect, sync_playwright

    running, prometheus_port = server
    banner = running.output()
    dashboard = re.search(r"dashboard: (http://\S+) \(it asks for Ray's token: `ray get-auth-token`", banner)
    prometheus = f"http://127.0.0.1:{prometheus_port}"
    assert dashboard is not None, banner
    assert f"metrics: Prometheus at {prometheus}" in banner
    for _ in range(20):  # searches for the router to count
        response = httpx.post(f"{running.url}/v1/search", json={"vector": np.zeros(784).tolist(), "k": 5},
                              timeout=30)
        assert response.status_code == 200, response.text
    token = subprocess.run([str(RAY), "get-auth-token"], capture_output=True, text=True,
                           check=True).stdout.strip()

    def scraped() -> bool:  # the router exported it and Prometheus scraped it (Ray's export interval)
        answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": SERIES}, timeout=10).json()
        return bool(answer["data"]["result"])

    running.wait_for(scraped, f"{SERIES} in Prometheus", timeout_s=180, interval_s=1)

    with sync_playwright() as playwright:
        browser = _browser(playwright)
        try:
            page = browser.new_page()
            page.goto(f"{dashboard[1]}/#/serve")
            dialog = page.get_by_role("dialog")
            expect(dialog).to_contain_text("Authentication Token Required", timeout=60_000)
            dialog.locator("input").fill(token)
            dialog.get_by_role("button", name="Submit").click()
            for shard in ("shard-000", "shard-001"):  # each shard its own deployment
                expect(page.get_by_text(shard, exact=True).first).to_be_visible(timeout=60_000)
            health = page.request.get(f"{dashboard[1]}/api/prometheus_health")  # the dashboard found it
            assert health.ok and "prometheus running" in health.text(), health.text()

            page.goto(f"{prometheus}/graph?g0.expr={quote(SERIES)}&g0.tab=0&g0.range_input=5m")
            series = page.get_by_role("listitem").filter(has_text="ray_shardserve_request_latency_ms_count")
            expect(series.first).to_contain_text('application="shardserve"', timeout=60_000)  # the legend
            expect(series.first).to_contain_text('status="200"')
        finally:
            browser.close()

    running.signal(signal.SIGINT)
    assert running.finish()[0] == 0
    wait_for(lambda: not running.pids(), "every process of the server gone, Prometheus included",
             timeout_s=60)
