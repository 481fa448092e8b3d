"""The demo's LLM engine (started by `spanlet demo`): a separate process from
its HTTP front end (agent/demo/frontend.py), as a serving engine is, running
a continuous-batching loop over the stand-in CUDA runtime.

The front end connects to the engine's Unix socket and sends one JSON line per
request: {"id", "prompt_tokens", "max_tokens", "trace"} ("trace": the request
span's W3C trace context, as vLLM carries its trace headers). The engine
answers one line per token, {"id", "token"}, and a last {"id", "done",
"tokens", "steps"}.

Each iteration of the loop, between steps:

- requests that arrived join the batch (at most MAX_BATCH run at once; the
  others wait) and get a prefill step of their own: PREFILL_KERNELS plus one
  kernel per PREFILL_TOKENS_PER_KERNEL prompt tokens launched
  (cudaLaunchKernel), linked to each joined request with its prompt tokens as
  weight; it makes each one's first token;
- then one decode step for every running request (weight 1: one token each):
  one replay (cudaGraphLaunch) of the decode graph of its batch size, padded
  to the next of GRAPH_SIZES; a size's graph is captured the first time a batch
  of that size runs (its GRAPH_KERNELS[size] launches recorded into it, not
  run), as engines that capture lazily do;
- each step ends with a cudaStreamSynchronize whose "GPU time" grows with the
  tokens in it; finished requests leave.

Every step is a span opened with `spanlet.batch.step()` (the agent gives each
linked request its share of the step's kernel facts) with attributes
demo.step.kind (prefill|decode), demo.step.requests, demo.step.tokens and
demo.step.kernels (kernels launched, or the replayed graph's kernels). Tokens
go to the front end after their step's span has ended.

Prints "ready" once listening; ends on SIGTERM after exporting its spans,
printing "steps N prefill P decode D graphs G served R".
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from spanlet import batch
from spanlet.demo.worker import Gpu, start, tracer_provider

MAX_BATCH = 8
GRAPH_SIZES = (1, 2, 4, 8)
GRAPH_KERNELS = {1: 14, 2: 16, 4: 20, 8: 28}   # a decode graph's kernels, per padded batch size
PREFILL_KERNELS = 6
PREFILL_TOKENS_PER_KERNEL = 64
STREAM = 0x5000                                # the engine's compute stream (a stand-in handle)
MODEL = "demo-llm"


def prefill_kernels(prompt_tokens: int) -> int:
    """Kernels a prefill step of these many prompt tokens launches."""
    return PREFILL_KERNELS + -(-prompt_tokens // PREFILL_TOKENS_PER_KERNEL)


def graph_size(running: int) -> int:
    return next(s for s in GRAPH_SIZES if s >= running)


@dataclass
class Request:
    id: int
    prompt_tokens: int
    max_tokens: int
    trace: dict
    tokens: int = 0
    steps: int = 0


@dataclass
class Stats:
    prefill: int = 0
    decode: int = 0
    served: int = 0
    graphs: dict = field(default_factory=dict)    # padded batch size → executable graph


class Engine:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.provider = tracer_provider("demo-llm-engine", "llm-engine-0", args.otlp_endpoint,
                                        delay_ms=100)
        self.tracer = self.provider.get_tracer("spanlet.demo.engine")
        self.gpu = Gpu(Path(args.lib_dir), "runtime")
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = Stats()
        self.conn: socket.socket | None = None

    # -- the front end's connection ----------------------------------------------------
    def listen(self) -> socket.socket:
        path = self.args.socket
        if os.path.exists(path):
            os.unlink(path)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()
        return srv

    def _accept(self, srv: socket.socket) -> None:
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        self.conn = conn
        with conn.makefile("rb") as f:
            for line in f:
                try:
                    m = json.loads(line)
                    self.inbox.put(Request(int(m["id"]), int(m["prompt_tokens"]),
                                           max(1, int(m["max_tokens"])), dict(m.get("trace") or {})))
                except (ValueError, KeyError, TypeError) as e:
                    print(f"engine: bad request line {line[:200]!r}: {e}", file=sys.stderr, flush=True)

    def _send(self, messages: list[dict]) -> None:
        if self.conn is not None and messages:
            try:
                self.conn.sendall(b"".join(json.dumps(m).encode() + b"\n" for m in messages))
            except OSError:
                self.conn = None    # the front end is gone: the demo is ending

    # -- the loop ------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._take(block=not (self.running or self.waiting))
            joined = []
            while self.waiting and len(self.running) + len(joined) < MAX_BATCH:
                joined.append(self.waiting.popleft())
            out: list[dict] = []
            if joined:
                self._prefill(joined)
                self.running += joined
                out += self._tokens(joined)
                self._send(self._leave(out))
                out = []
            if self.running:
                self._decode(self.running)
                out += self._tokens(self.running)
                self._send(self._leave(out))

    def _take(self, block: bool) -> None:
        try:
            if block:
                self.waiting.append(self.inbox.get(timeout=0.2))
            while True:
                self.waiting.append(self.inbox.get_nowait())
        except queue.Empty:
            pass

    def _prefill(self, joined: list[Request]) -> None:
        tokens = sum(r.prompt_tokens for r in joined)
        kernels = prefill_kernels(tokens)
        with self._step("prefill", [(r.trace, r.prompt_tokens) for r in joined], tokens, kernels):
            self.gpu.launch(kernels, grid=128, stream=STREAM)
            self.gpu.sync(500 + 8 * tokens)
        self.stats.prefill += 1

    def _decode(self, running: list[Request]) -> None:
        size = graph_size(len(running))
        exe = self.stats.graphs.get(size)
        if exe is None:
            with self.tracer.start_as_current_span("engine.capture_graph", attributes={
                    "demo.graph.batch_size": size, "demo.graph.kernels": GRAPH_KERNELS[size]}):
                exe = self.stats.graphs[size] = self.gpu.capture(GRAPH_KERNELS[size], STREAM)
        with self._step("decode", [(r.trace, 1) for r in running], len(running), GRAPH_KERNELS[size],
                        {"demo.step.graph_batch_size": size}):
            self.gpu.replay(exe, STREAM)
            self.gpu.sync(8000 + 1500 * len(running))
        self.stats.decode += 1

    def _step(self, kind: str, links: list, tokens: int, kernels: int, extra: dict | None = None):
        attrs = {"demo.step.kind": kind, "demo.step.requests": len(links), "demo.step.tokens": tokens,
                 "demo.step.kernels": kernels, "gen_ai.request.model": MODEL, **(extra or {})}
        return batch.step(self.tracer, links, name=f"engine.{kind}", attributes=attrs)

    def _tokens(self, requests: list[Request]) -> list[dict]:
        out = []
        for r in requests:
            r.tokens += 1
            r.steps += 1
            out.append({"id": r.id, "token": f"t{r.tokens}"})
        return out

    def _leave(self, out: list[dict]) -> list[dict]:
        """The finished requests leave the batch: their last line."""
        still = []
        for r in self.running:
            if r.tokens >= r.max_tokens:
                out.append({"id": r.id, "done": True, "tokens": r.tokens, "steps": r.steps})
                self.stats.served += 1
            else:
                still.append(r)
        self.running = still
        return out

    def close(self) -> None:
        self.provider.shutdown()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spanlet.demo.engine")
    p.add_argument("--socket", required=True, help="the Unix socket the front end connects to")
    p.add_argument("--lib-dir", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args, stop = start(_parser(), argv)
    if stop is None:
        return 0
    engine = Engine(args)
    srv = engine.listen()
    print("ready", flush=True)
    loop = threading.Thread(target=engine.run, args=(stop,), daemon=True)
    loop.start()
    stop.wait()
    loop.join(10)
    srv.close()
    engine.close()
    s = engine.stats
    print(f"steps {s.prefill + s.decode} prefill {s.prefill} decode {s.decode} graphs {len(s.graphs)} "
          f"served {s.served}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
