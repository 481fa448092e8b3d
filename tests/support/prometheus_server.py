"""A real Prometheus server (Debian's `prometheus`) on a free loopback port that
scrapes one target every second."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from processes import free_port


class Prometheus:
    def __init__(self, tmp: Path, target: str, honor_labels: bool = False):
        self.port = free_port()
        cfg = tmp / "prometheus.yml"
        cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                       "scrape_configs:\n  - job_name: spanlet\n"
                       + ("    honor_labels: true\n" if honor_labels else "")
                       + f"    static_configs:\n      - targets: ['{target}']\n")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def query(self, expr: str) -> list[dict]:
        """The result of an instant query; [] while the server is not up or
        not ready yet (503). An expression the server refuses raises (HTTPError
        400 or 422)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            if e.code in (400, 422):
                raise
            return []
        except OSError:
            return []
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_scraped(self, times: int = 1, limit_s: float = 60) -> None:
        """Until Prometheus is up and has scraped the target successfully
        `times` times in the last max(10, 2 x times) seconds (a server that
        starts from a cold disk can take seconds before its first scrape)."""
        expr = f'sum_over_time(up{{job="spanlet"}}[{max(10, 2 * times)}s]) >= {times}'
        deadline = time.monotonic() + limit_s
        while not self.query(expr):
            if time.monotonic() > deadline:
                raise AssertionError(f"Prometheus did not scrape its target {times} times within {limit_s:g} s")
            time.sleep(0.2)

    def value(self, expr: str) -> float | None:
        res = self.query(expr)
        return float(res[0]["value"][1]) if res else None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
