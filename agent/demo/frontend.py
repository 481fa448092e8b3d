"""The demo's LLM front end (started by `spanlet demo`): an asyncio HTTP/1.1
server inside the demo's network namespace, in front of the engine process
(agent/demo/engine.py), as an OpenAI-style server sits in front of its engine.

    POST /v1/completions  {"prompt_tokens": N, "max_tokens": M}   (traceparent optional)

Each request is an OpenTelemetry SERVER span (parent from its `traceparent`)
made by the SDK with the spanlet span processor; the request goes to the
engine with the span's W3C trace context (`spanlet.batch.request_headers()`),
and the tokens come back as a chunked response, one JSON line per token as
each engine step makes it ({"token": ...}), then {"done": true, "tokens": N}.
The span carries the serving attributes the agent's metrics read (modality,
SLO class, model, input and output tokens, a `first_token` event); the agent
puts on it the request's share of the engine's steps (kernel.batch.*).

Prints "ready" once serving; ends on SIGTERM after exporting its spans,
printing "served N tokens T".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys

from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from spanlet import batch
from spanlet.demo.engine import MODEL
from spanlet.demo.net import socket_in
from spanlet.demo.worker import start, tracer_provider

PATH = "/v1/completions"
MAX_HEADERS = 100
MAX_BODY = 64 << 10
ENGINE_CONNECT_S = 30.0
DRAIN_S = 5.0              # how long requests under way may finish once the demo stops


class BadRequest(Exception):
    pass


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def response_head(status: str, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    return "\r\n".join(lines).encode()


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes]:
    """(method, path, headers with lower-case names, body) of one HTTP/1.1 request."""
    line = (await reader.readline()).decode("latin-1").split()
    if len(line) != 3:
        raise BadRequest("bad request line")
    headers: dict[str, str] = {}
    while True:
        h = (await reader.readline()).decode("latin-1")
        if h in ("\r\n", "\n", ""):
            break
        name, _, value = h.partition(":")
        headers[name.strip().lower()] = value.strip()
        if len(headers) > MAX_HEADERS:
            raise BadRequest("too many headers")
    length = int(headers.get("content-length") or 0)
    if not 0 <= length <= MAX_BODY:
        raise BadRequest("body too large")
    return line[0], line[1], headers, await reader.readexactly(length)


class FrontEnd:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.provider = tracer_provider("demo-llm-frontend", "llm-frontend-0", args.otlp_endpoint)
        self.tracer = self.provider.get_tracer("spanlet.demo.frontend")
        self.pending: dict[int, asyncio.Queue] = {}
        self.next_id = 0
        self.served = 0
        self.tokens = 0
        self.engine_w: asyncio.StreamWriter | None = None

    async def connect_engine(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ENGINE_CONNECT_S
        while True:
            try:
                reader, self.engine_w = await asyncio.open_unix_connection(self.args.engine_socket)
                break
            except OSError:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.1)
        asyncio.get_running_loop().create_task(self._from_engine(reader))

    async def _from_engine(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            m = json.loads(line)
            q = self.pending.get(m.get("id"))
            if q is not None:
                q.put_nowait(m)
        self.engine_w = None
        for q in self.pending.values():    # the engine is gone: every request ends
            q.put_nowait(None)

    # -- one connection, one request ----------------------------------------------------
    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                method, path, headers, body = await read_request(reader)
                if method != "POST" or path != PATH:
                    raise BadRequest(f"only POST {PATH}")
                params = json.loads(body or b"{}")
                prompt, max_tokens = int(params["prompt_tokens"]), int(params["max_tokens"])
                if not (0 < prompt <= 1 << 20 and 0 < max_tokens <= 4096):
                    raise BadRequest("prompt_tokens or max_tokens out of range")
            except (BadRequest, ValueError, KeyError, TypeError) as e:
                writer.write(response_head("400 Bad Request", {"Content-Length": "0",
                                                               "Connection": "close"}))
                print(f"frontend: bad request: {e}", file=sys.stderr, flush=True)
                return
            await self.complete(headers, prompt, max_tokens, writer)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def complete(self, headers: dict[str, str], prompt: int, max_tokens: int,
                       writer: asyncio.StreamWriter) -> None:
        ctx = TraceContextTextMapPropagator().extract(headers)
        attrs = {"mm.modality": "text", "slo.class": "gold", "gen_ai.request.model": MODEL,
                 "gen_ai.usage.input_tokens": prompt, "gen_ai.request.max_tokens": max_tokens}
        with self.tracer.start_as_current_span(f"POST {PATH}", context=ctx, kind=SpanKind.SERVER,
                                               attributes=attrs) as span:
            rid, self.next_id = self.next_id, self.next_id + 1
            q = self.pending[rid] = asyncio.Queue()
            tokens, client = 0, True
            try:
                if self.engine_w is None:
                    raise OSError("no engine")
                self.engine_w.write(json.dumps({"id": rid, "prompt_tokens": prompt, "max_tokens": max_tokens,
                                                "trace": batch.request_headers()}).encode() + b"\n")
                await self.engine_w.drain()
                writer.write(response_head("200 OK", {"Content-Type": "application/x-ndjson",
                                                      "Transfer-Encoding": "chunked", "Connection": "close"}))
                while (m := await q.get()) is not None and not m.get("done"):
                    if tokens == 0:
                        span.add_event("first_token")
                    tokens += 1
                    if client:    # a client that went away: the request still runs to its end
                        client = await _write(writer, chunk(json.dumps({"token": m["token"]}).encode() + b"\n"))
                if m is None:
                    raise OSError("the engine went away")
                if client:
                    await _write(writer, chunk(json.dumps({"done": True, "tokens": tokens}).encode() + b"\n")
                                 + chunk(b""))
            except OSError as e:
                span.set_status(Status(StatusCode.ERROR, str(e)))
            finally:
                del self.pending[rid]
            span.set_attribute("gen_ai.usage.output_tokens", tokens)
        self.served += 1
        self.tokens += tokens

    # -- the server ---------------------------------------------------------------
    async def serve(self, stop) -> None:
        await self.connect_engine()
        sock = socket_in(self.args.netns)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.args.address, self.args.port))
        sock.listen(128)
        sock.setblocking(False)
        server = await asyncio.start_server(self.handle, sock=sock)
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, stop.wait)
        server.close()
        # requests under way finish (the demo stopped its clients), for a while: a
        # demo killed outright took its clients and its engine with it
        deadline = loop.time() + DRAIN_S
        while self.pending and self.engine_w is not None and loop.time() < deadline:
            await asyncio.sleep(0.05)


async def _write(writer: asyncio.StreamWriter, data: bytes) -> bool:
    try:
        writer.write(data)
        await writer.drain()
        return True
    except OSError:
        return False


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spanlet.demo.frontend")
    p.add_argument("--netns", required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--engine-socket", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args, stop = start(_parser(), argv)
    if stop is None:
        return 0
    fe = FrontEnd(args)
    try:
        asyncio.run(fe.serve(stop))
    finally:
        fe.provider.shutdown()
    print(f"served {fe.served} tokens {fe.tokens}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
