"""Eager tasks (Python 3.12's asyncio.eager_task_factory) run their first step
at once, inside their creator's step and outside any loop callback: the
client follows that step too, on asyncio's loop and on uvloop, and the
creator is back on its own span right after. Run by a 3.12 interpreter in a
child (this suite's own is 3.11), with the record build of the marker made
for it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import marker_build
import other_python
from require import cannot_run

SUPPORT = Path(__file__).resolve().parents[1] / "support"

CHILD = r"""
import asyncio, json, sys
import uvloop
from opentelemetry.sdk.trace import TracerProvider
from spanlet import client
from marker_build import Recorder, span_mark, CLEAR

rec = Recorder(sys.argv[1])
provider = TracerProvider()
provider.add_span_processor(client.SpanletSpanProcessor(rec.path))
tracer = provider.get_tracer("t")
STEPS, REQUESTS = 3, 4


def scenario(run, set_factory):
    rec.reset()
    views, spans = [], {}

    async def request(i):
        with tracer.start_as_current_span(f"r{i}") as span:
            spans[i] = span
            for _ in range(STEPS):
                views.append((f"r{i}", rec.current()))
                await asyncio.sleep(0)

    async def main():
        set_factory(asyncio.get_running_loop())
        with tracer.start_as_current_span("accept") as span:
            spans["accept"] = span
            tasks = []
            for i in range(REQUESTS):
                tasks.append(asyncio.get_running_loop().create_task(request(i)))
                views.append(("accept", rec.current()))     # back on its own span after the eager step
            await asyncio.gather(*tasks)

    run(main())
    mine = {k: span_mark(s) for k, s in spans.items()}
    return {"exact": all(v == mine[int(k[1:]) if k != "accept" else "accept"]
                         for k, v in views),
            "order": [k for k, _ in views]}


eager = lambda loop: loop.set_task_factory(asyncio.eager_task_factory)                     # noqa: E731
custom = lambda loop: loop.set_task_factory(asyncio.create_eager_task_factory(asyncio.Task))  # noqa: E731
out = {f"{name}/{how}": scenario(run, factory)
       for name, run in (("asyncio", asyncio.run), ("uvloop", uvloop.run))
       for how, factory in (("eager_task_factory", eager), ("create_eager_task_factory", custom))}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def py312():
    python = other_python.find("3.12")
    if python is None:
        cannot_run("no Python 3.12 interpreter here (eager tasks are 3.12's)")
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spanlet" / "other-python"
    exe, path = other_python.client_env(python, cache)
    out = Path(tempfile.mkdtemp(prefix="spanlet-eager-"))
    try:
        lib = marker_build.build(out, "librecord312.so", "-DSPANLET_MARKER_RECORD", python=exe)
        yield exe, path, lib
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(path, ignore_errors=True)


def test_the_first_eager_step_runs_on_its_own_span_and_the_creator_gets_its_own_back(py312):
    exe, path, lib = py312
    r = subprocess.run([exe, "-c", CHILD, lib], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([path, str(SUPPORT)])})
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout)
    assert set(results) == {f"{loop}/{how}" for loop in ("asyncio", "uvloop")
                            for how in ("eager_task_factory", "create_eager_task_factory")}
    # eager: each request's first step runs inside accept's step, before accept goes on
    first = [x for i in range(4) for x in (f"r{i}", "accept")]
    later = [f"r{i}" for i in range(4)] * 2
    for name, got in results.items():
        assert got["order"] == first + later, name
        assert got["exact"] is True, name
