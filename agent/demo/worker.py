"""One process of the demo's serving workload (started by `spanlet demo`, one
per modality, plus one rogue). A serving worker:

- serves HTTP/1.1 POSTs on a socket inside the demo's network namespace; each
  request is an OpenTelemetry SERVER span (parent from its `traceparent`),
  exported over OTLP to the agent and marked for the kernel by the spanlet
  span processor;
- inside the span, launches "kernels" through the stand-in CUDA libraries and
  waits on stream synchronisation, both growing with its load (requests in
  flight), and emits a `first_token` event after the first decode step;
- writes the serving attributes the agent's metrics read: modality, SLO
  class, model, output tokens, KV-cache use, media timestamps (video: an
  audio and a video decode span per request), degradations under load, image
  and caption embeddings that drift apart;
- maps the demo's tensor pools as its grants allow (weights read-only, KV
  cache read-write) and keeps them mapped;
- audio and video workers also receive the demo's RTP streams.

The rogue worker maps what it must not, every few seconds: a file of the
pool folder that is no pool, and the read-only weights writable.

Each prints "ready" once serving and ends on SIGTERM after exporting its
spans. argv: see _parser().
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import mmap
import os
import random
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from spanlet.demo.net import socket_in

MODELS = {"text": "demo-llm", "image": "demo-vlm", "audio": "demo-asr", "video": "demo-vlm"}
SLO_CLASSES = {"text": "gold", "image": "silver", "audio": "gold", "video": "bronze"}
EMBED_DIMS = 16
FUNC = ctypes.c_void_p(0xF00D)  # the "kernel" every launch names


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class Gpu:
    """Launches and syncs through the stand-in libraries: the runtime API for
    text and audio, the driver API for image and video (both are hooked)."""

    def __init__(self, lib_dir: Path, api: str):
        self.driver = ctypes.CDLL(str(lib_dir / "libcuda.so.1"))
        self.runtime = ctypes.CDLL(str(lib_dir / "libcudart.so.12"))
        self.api = api
        self.runtime.cudaLaunchKernel.argtypes = [ctypes.c_void_p, Dim3, Dim3, ctypes.c_void_p,
                                                  ctypes.c_size_t, ctypes.c_void_p]
        self.driver.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.runtime.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        self.driver.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        rt, ptr = self.runtime, ctypes.POINTER(ctypes.c_void_p)
        rt.cudaStreamBeginCapture.argtypes = [ctypes.c_void_p, ctypes.c_int]
        rt.cudaStreamEndCapture.argtypes = [ctypes.c_void_p, ptr]
        rt.cudaGraphInstantiate.argtypes = [ptr, ctypes.c_void_p, ctypes.c_ulonglong]
        rt.cudaGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]

    def launch(self, n: int, grid: int, stream: int | None = None) -> None:
        for _ in range(n):
            if self.api == "runtime":
                self.runtime.cudaLaunchKernel(FUNC, Dim3(grid, 1, 1), Dim3(256, 1, 1), None, 0, stream)
            else:
                self.driver.cuLaunchKernel(FUNC, grid, 1, 1, 256, 1, 1, 0, stream, None, None)

    def capture(self, kernels: int, stream: int) -> ctypes.c_void_p:
        """An executable graph of `kernels` kernels, captured on `stream` (the
        launches are recorded, not run) and instantiated, through the runtime."""
        rt, graph, exe = self.runtime, ctypes.c_void_p(), ctypes.c_void_p()
        _ok(rt.cudaStreamBeginCapture(stream, 0), "cudaStreamBeginCapture")
        for k in range(kernels):
            rt.cudaLaunchKernel(FUNC, Dim3(32 + k, 1, 1), Dim3(128, 1, 1), None, 0, stream)
        _ok(rt.cudaStreamEndCapture(stream, ctypes.byref(graph)), "cudaStreamEndCapture")
        _ok(rt.cudaGraphInstantiate(ctypes.byref(exe), graph, 0), "cudaGraphInstantiate")
        return exe

    def replay(self, exe: ctypes.c_void_p, stream: int) -> None:
        _ok(self.runtime.cudaGraphLaunch(exe, stream), "cudaGraphLaunch")

    def sync(self, wait_us: int) -> None:
        """The stand-in's stream handle is how long the "GPU" takes, in µs."""
        stream = ctypes.c_void_p(max(1, int(wait_us)))
        if self.api == "runtime":
            self.runtime.cudaStreamSynchronize(stream)
        else:
            self.driver.cuStreamSynchronize(stream)


def _ok(rc: int, call: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{call} returned {rc}")


def map_pool(path: Path, writable: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=prot)
    finally:
        os.close(fd)


def tracer_provider(service: str, pod: str, endpoint: str, delay_ms: int = 500):
    """An OTel SDK provider as a serving process has one: the spanlet span
    processor (marks each thread's current span for the kernel) and a batch
    export over OTLP/gRPC every `delay_ms`."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from spanlet import SpanletSpanProcessor

    provider = TracerProvider(resource=Resource.create({
        "service.name": service, "k8s.namespace.name": "spanlet-demo", "k8s.pod.name": pod}))
    provider.add_span_processor(SpanletSpanProcessor())
    provider.add_span_processor(BatchSpanProcessor(
        # a short export timeout: a process whose agent is gone (a killed demo)
        # stops in seconds, not after the SDK's 10 s of retries per batch
        OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=2),
        schedule_delay_millis=delay_ms))
    return provider


class Worker:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.modality = args.modality
        self.rng = random.Random(args.seed)
        self.rng_lock = threading.Lock()
        self.started = time.monotonic()
        self.inflight = 0
        self.served = 0
        self.lock = threading.Lock()
        self.provider = tracer_provider(f"demo-{self.modality}", f"{self.modality}-worker-0",
                                        args.otlp_endpoint)
        self.tracer = self.provider.get_tracer("spanlet.demo")
        self.gpu = Gpu(Path(args.lib_dir), "runtime" if self.modality in ("text", "audio") else "driver")
        pools = Path(args.pool_dir)
        self.maps = [map_pool(pools / "weights", writable=False), map_pool(pools / "kv", writable=True)]
        self.rtp_packets = 0

    # -- the model of load ---------------------------------------------------------
    def _load(self) -> float:
        """0..1: requests in flight, and a slow wave so that figures move."""
        wave = 0.5 + 0.5 * math.sin((time.monotonic() - self.started) / 20.0)
        return min(1.0, 0.25 * self.inflight + 0.5 * wave)

    def _uniform(self, a: float, b: float) -> float:
        with self.rng_lock:
            return self.rng.uniform(a, b)

    def _embedding(self, drift_per_s: float) -> list[float]:
        """A vector that turns with time at `drift_per_s` rad/s, plus noise."""
        drift = drift_per_s * (time.monotonic() - self.started)
        return [round(math.cos(i + drift) + self._uniform(-0.05, 0.05), 4) for i in range(EMBED_DIMS)]

    # -- one request ---------------------------------------------------------------
    def handle(self, headers: dict[str, str], body: bytes) -> bytes:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        ctx = TraceContextTextMapPropagator().extract(headers)
        with self.lock:
            self.inflight += 1
        try:
            load = self._load()
            attrs = {"mm.modality": self.modality, "slo.class": SLO_CLASSES[self.modality],
                     "gen_ai.request.model": MODELS[self.modality]}
            with self.tracer.start_as_current_span(f"{self.modality}.infer", context=ctx,
                                                   kind=SpanKind.SERVER, attributes=attrs) as span:
                return self._work(span, load, len(body))
        finally:
            with self.lock:
                self.inflight -= 1
                self.served += 1

    def _work(self, span, load: float, body_bytes: int) -> bytes:
        steps = {"text": 8, "image": 4, "audio": 3, "video": 6}[self.modality]
        per_step = 2 + int(body_bytes / 4096)
        wait_us = int((2000 + 30000 * load) * self._uniform(0.7, 1.3))
        tokens = 0
        for step in range(steps):
            self.gpu.launch(per_step, grid=64 + 32 * step)
            self.gpu.sync(wait_us // steps)
            tokens += int(self._uniform(8, 24))
            if step == 0:
                span.add_event("first_token")
        span.set_attribute("gen_ai.usage.output_tokens", tokens)
        span.set_attribute("gen_ai.kv_cache.usage_ratio", round(0.3 + 0.5 * load, 3))
        if self.modality == "image":
            # The image embedding drifts away from its caption's (#16 compares
            # two modalities' embeddings of one pod).
            span.set_attribute("mm.embedding", self._embedding(0.03))
            with self.tracer.start_as_current_span("image.embed_caption", attributes={
                    "mm.modality": "text", "mm.embedding": self._embedding(0.0)}):
                self.gpu.launch(1, grid=8)
        if self.modality == "image" and (load > 0.8 or self._uniform(0, 1) < 0.05):
            with self.tracer.start_as_current_span("image.ocr_fallback", attributes={
                    "mm.modality": "text", "mm.degraded_from": "vision",
                    "mm.degraded_to": "ocr_text"}):
                self.gpu.launch(1, grid=16)
        if self.modality == "audio" and self._uniform(0, 1) < 0.05:
            span.set_attribute("mm.degraded_from", "audio")
            span.set_attribute("mm.degraded_to", "transcript_text")
        if self.modality == "video":
            pts = time.time_ns()
            skew = int(self._uniform(0, 60_000_000 + 80_000_000 * load))
            for modality, at in (("audio", pts), ("video", pts + skew)):
                with self.tracer.start_as_current_span(f"video.decode_{modality}", attributes={
                        "mm.modality": modality, "mm.pts_ns": at}):
                    self.gpu.launch(1, grid=32)
        return json.dumps({"modality": self.modality, "tokens": tokens}).encode() + b" " * 2048

    # -- serving -------------------------------------------------------------------
    def serve(self) -> ThreadingHTTPServer:
        worker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802 (http.server's name)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                out = worker.handle({k.lower(): v for k, v in self.headers.items()}, body)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        srv = ThreadingHTTPServer((self.args.address, self.args.port), Handler,
                                  bind_and_activate=False)
        srv.daemon_threads = True
        srv.socket.close()
        srv.socket = socket_in(self.args.netns)
        srv.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.server_bind()
        srv.server_activate()
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.2},
                         daemon=True).start()
        return srv

    def receive_rtp(self, port: int) -> None:
        sock = socket_in(self.args.netns, socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((self.args.address, port))
        sock.settimeout(0.5)

        def loop():
            while True:
                try:
                    sock.recv(2048)
                    self.rtp_packets += 1
                except socket.timeout:
                    continue
                except OSError:
                    return
        threading.Thread(target=loop, daemon=True).start()

    def close(self) -> None:
        self.provider.shutdown()  # exports what is left
        for m in self.maps:
            m.close()


def rogue(args: argparse.Namespace, stop: threading.Event) -> None:
    """Maps what no grant allows, every --interval seconds, until stopped."""
    pools = Path(args.pool_dir)
    print("ready", flush=True)
    n = 0
    while not stop.wait(0 if n == 0 else args.interval):
        for path, flags, prot in ((pools / "scratch", os.O_RDONLY, mmap.PROT_READ),
                                  (pools / "weights", os.O_RDWR, mmap.PROT_READ | mmap.PROT_WRITE)):
            fd = os.open(path, flags)
            try:
                mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=prot).close()
            finally:
                os.close(fd)
        n += 1
    print(f"rogue mappings {2 * n}", flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spanlet.demo.worker")
    p.add_argument("--modality", choices=sorted(MODELS) + ["rogue"], required=True)
    p.add_argument("--netns", required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--rtp-port", type=int, default=0)
    p.add_argument("--lib-dir", required=True)
    p.add_argument("--pool-dir", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--interval", type=float, default=5.0)
    return p


PR_SET_PDEATHSIG = 1


def child_of(parent: int) -> threading.Event | None:
    """A demo process's start: the event SIGTERM and SIGINT set, or None when
    the demo (pid `parent`) is gone already. A demo killed outright must not
    leave its processes running: they get SIGTERM when it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        return None
    stop = threading.Event()
    fired: list[int] = []

    def on_signal(signum, _frame) -> None:
        # A signal that lands while the handler of an earlier one is inside
        # stop.set() must not call it again: the event's lock is not reentrant
        # (a demo killed outright sent several, and its front end hung there).
        # The list is marked before set() is called, with no lock.
        if fired:
            return
        fired.append(signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def start(parser: argparse.ArgumentParser, argv: list[str] | None):
    """A demo process's arguments (with the common --otlp-endpoint and
    --parent) and its stop event (None: the demo is gone, end now)."""
    parser.add_argument("--otlp-endpoint", default="http://127.0.0.1:4317")
    parser.add_argument("--parent", type=int, required=True, help="the demo's pid")
    args = parser.parse_args(argv)
    return args, child_of(args.parent)


def main(argv: list[str] | None = None) -> int:
    args, stop = start(_parser(), argv)
    if stop is None:
        return 0
    if args.modality == "rogue":
        rogue(args, stop)
        return 0
    worker = Worker(args)
    srv = worker.serve()
    if args.rtp_port:
        worker.receive_rtp(args.rtp_port)
    print("ready", flush=True)
    stop.wait()
    srv.shutdown()
    worker.close()
    print(f"served {worker.served} rtp {worker.rtp_packets}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
