"""vLLM integration: each engine step a `spanlet.batch.step` span linked to the
`llm_request` spans of the requests it served, weighted by the tokens it
scheduled for each, so that the agent gives each request its share of the
step's kernel facts (DESIGN.md, "Batched steps").

It installs with the client: the entry point `vllm.general_plugins: spanlet`,
which vLLM calls in each of its processes (API server, engine core, workers)
when `spanlet` is installed in its environment. `SPANLET_VLLM=0` turns it off
(vLLM's own `VLLM_PLUGINS` allow-list too). It does anything only where vLLM
traces (`--otlp-traces-endpoint`): without it vLLM makes no `llm_request`
span to share to.

How the request's span is known at step time. vLLM makes `llm_request` (a
SERVER span, the incoming `traceparent` its parent) only when the request
finishes, in the API server; the steps run earlier, in another process. So
its span id is chosen, not drawn: the API server draws it as the HTTP request
comes in and sends it to the engine in the request's trace headers
(SPAN_HEADER); where there is none (a parallel-sampling child past the
first, a second prompt of one HTTP request) both sides derive it from what
both know, the trace id of the request's `traceparent` and vLLM's request id
(`request_span_id`). The API server's `OutputProcessor.do_tracing` makes the
span with that id; the engine's `Scheduler.schedule` puts the links of the
step it scheduled, (trace id, that span id, tokens scheduled), on the
`SchedulerOutput`, which reaches every worker; the worker
(`WorkerWrapperBase.execute_model` to `sample_tokens`) makes the step span,
current in its thread while the model runs, so the step's facts (GPU launches,
syncs, copies; CPU, run queue, blocked time) are its own. The links point at
the real span: a trace viewer follows them too.

The front end's own work (rendering the request: tokenizing, processing its
images and audio) runs in the API server before the engine sees the request,
inside `spanlet.vllm.front_end`, the chosen id's child (below): the agent adds
its facts to llm_request's request totals (`kernel.request.*`).

With tensor parallelism every rank makes its step span; ranks other than 0
carry `spanlet.batch.shard` (their rank), and the agent counts a step once
while adding every rank's facts to the shares.

vLLM makes no llm_request for a request it aborts (its client went away): the
plugin makes it (`OutputProcessor.abort_requests`), so the steps it took part
in are kept; a preempted request keeps its id, and so its links.

A vLLM whose internals moved (a class or method missing) makes the plugin log
one line and step aside: nothing is patched then. Any error at step time
turns the step spans off with one line; serving goes on.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import os
import random
import re
import threading

from spanlet.batch import request_context

# under vLLM's own logger: its lines come out where and as vLLM's do
log = logging.getLogger("vllm.spanlet")

ENV = "SPANLET_VLLM"
STEP_SPAN_NAME = "spanlet.batch.step"
WEIGHTS = "spanlet.batch.weights"   # on a step span: each link's weight (tokens), in link order
SHARD = "spanlet.batch.shard"
# on a SchedulerOutput: ((trace id, request span id, tokens), ...) of the step's traced requests
LINKS_ATTR = "_spanlet_links"
_OPEN_ATTR = "_spanlet_open"        # on a worker wrapper: (span, context token) of its open step
_IDS_ATTR = "_spanlet_ids"          # on an engine Request: (trace id, its span id), () untraced
# in vLLM's trace headers (API server → engine → back): the llm_request span id
# the API server chose for the request as it came in
SPAN_HEADER = "spanlet-llm-request-span-id"
FRONT_END_SPAN_NAME = "spanlet.vllm.front_end"
_CHILD = re.compile(r"\d+_")
# the places the plugin hooks, as (module, class, method, in the API server
# only); a class of None: a module function
HOOKS = (
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", False),
    ("vllm.v1.worker.worker_base", "WorkerWrapperBase", "execute_model", False),
    # (0.32: not its own method, handed on to the worker by its __getattr__)
    ("vllm.v1.worker.worker_base", "WorkerWrapperBase", "sample_tokens", False),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "do_tracing", True),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "add_request", True),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "abort_requests", True),
    ("vllm.entrypoints.serve.engine.serving", "BaseServing", "_get_trace_headers", True),
    ("vllm.entrypoints.launchers.app", None, "init_entrypoints_middleware", True),
)

_state = threading.local()          # .span_id: the id the next span of this thread gets
_broken = False
_worker_tracer = None               # the workers' tracer, made on their first traced step
_patched: list[tuple[type, str, object]] = []
_links: dict[int, object] = {}      # request span id → its Link, in the workers
_LINKS_CACHED = 65536


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def request_span_id(trace_id: int, request_id: str, headers=None) -> int:
    """The span id of a request's `llm_request` span: the one the API server
    chose as the request came in (SPAN_HEADER in its trace headers, the parent
    of its front end's span), for the HTTP request's first engine request
    (a request id that is no parallel-sampling child `<i>_...` but `0_...`);
    otherwise 8 bytes of BLAKE2b over its trace id and vLLM's (internal)
    request id. Never 0."""
    chosen = headers.get(SPAN_HEADER) if headers else None
    if chosen and (not _CHILD.match(request_id) or request_id.startswith("0_")):
        try:
            sid = int(chosen, 16)
        except ValueError:
            sid = 0
        if 0 < sid < 1 << 64:
            return sid
    h = hashlib.blake2b(trace_id.to_bytes(16, "big") + request_id.encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") or 1


def trace_id_of(headers) -> int:
    """The trace id of a sampled W3C `traceparent` in headers, 0 if none."""
    ctx = request_context(headers) if headers else None
    return ctx.trace_id if ctx is not None and ctx.trace_flags.sampled else 0


def _step_aside(why: str, exc: BaseException | None = None) -> None:
    global _broken
    if not _broken:
        _broken = True
        log.warning("spanlet: vLLM step spans off (%s%s); serving goes on", why,
                    f": {type(exc).__name__}: {exc}" if exc is not None else "")


# -- the engine: which requests a step served ----------------------------------------

def _step_links(scheduler, out) -> tuple:
    reqs = scheduler.requests
    links = []
    for rid, n in out.num_scheduled_tokens.items():
        r = reqs.get(rid)
        if r is None:
            continue
        ids = getattr(r, _IDS_ATTR, None)
        if ids is None:             # once a request: (trace id, its span id), or ()
            tid = trace_id_of(r.trace_headers)
            ids = (tid, request_span_id(tid, rid, r.trace_headers)) if tid else ()
            setattr(r, _IDS_ATTR, ids)
        if ids:
            links.append((*ids, n))
    return tuple(links)


def _wrap_schedule(orig):
    def schedule(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if not _broken:
            try:
                links = _step_links(self, out)
                if links:
                    setattr(out, LINKS_ATTR, links)
            except Exception as e:
                _step_aside("reading the scheduled requests", e)
        return out
    return schedule


# -- the workers: the step span ---------------------------------------------------------

def _tracer():
    """The workers' tracer: a provider of the plugin's own (links up to the
    largest batch, a short export delay so that steps reach the agent before
    their requests), exporting where vLLM's do, with the span processor."""
    global _worker_tracer
    if _worker_tracer is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SpanLimits, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from spanlet.client import SpanletSpanProcessor

        endpoint = os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        exporter = Grpc(endpoint=endpoint, insecure=True) if protocol == "grpc" else Http(endpoint=endpoint)
        provider = TracerProvider(
            resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "vllm"),
                                      "vllm.process_kind": "worker"}),
            span_limits=SpanLimits(max_links=int(os.environ.get("SPANLET_VLLM_MAX_LINKS", "4096"))))
        provider.add_span_processor(SpanletSpanProcessor())
        provider.add_span_processor(BatchSpanProcessor(
            exporter, schedule_delay_millis=int(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "200"))))
        _worker_tracer = provider.get_tracer("spanlet.vllm")
    return _worker_tracer


def _close_step(wrapper) -> None:
    opened = wrapper.__dict__.pop(_OPEN_ATTR, None)
    if opened is not None:
        from opentelemetry import context
        span, token = opened
        try:
            context.detach(token)
        finally:
            span.end()


def _open_step(wrapper, links) -> None:
    from opentelemetry import context, trace
    from opentelemetry.trace import Link, SpanContext, TraceFlags

    _close_step(wrapper)            # a step whose sampling never came (deferred): ended here
    rank = getattr(wrapper, "rpc_rank", 0) or 0
    tokens = 0
    span_links = []
    cache = _links
    if len(cache) > _LINKS_CACHED:  # requests come and go: start again now and then
        cache.clear()
    weights = []
    for tid, sid, n in links:
        tokens += n
        weights.append(n)
        made = cache.get(sid)       # a request's link, made once
        if made is None:
            made = cache[sid] = Link(SpanContext(tid, sid, True, TraceFlags(TraceFlags.SAMPLED)))
        span_links.append(made)
    # the weights in one array, not an attribute on each link: the SDK copies a
    # link's attributes into a new mapping for every span (~2 µs a link)
    attrs = {"spanlet.batch.requests": len(links), "spanlet.batch.tokens": tokens, WEIGHTS: weights}
    if rank:
        attrs[SHARD] = rank
    span = _tracer().start_span(STEP_SPAN_NAME, links=span_links, attributes=attrs)
    wrapper.__dict__[_OPEN_ATTR] = (span, context.attach(trace.set_span_in_context(span)))


def _wrap_execute_model(orig):
    def execute_model(self, scheduler_output, *args, **kwargs):
        links = getattr(scheduler_output, LINKS_ATTR, None)
        if not links or _broken or "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" not in os.environ:
            return orig(self, scheduler_output, *args, **kwargs)
        try:
            _open_step(self, links)
        except Exception as e:
            _step_aside("starting a step span", e)
            return orig(self, scheduler_output, *args, **kwargs)
        try:
            out = orig(self, scheduler_output, *args, **kwargs)
        except BaseException:
            _close_step(self)
            raise
        if out is not None:         # the output is here: no sampling call follows
            _close_step(self)
        return out
    return execute_model


def _wrap_sample_tokens(orig):
    if orig is None:                # reached through the wrapper's __getattr__ (to its worker)
        def orig(self, *args, **kwargs):
            return self.__getattr__("sample_tokens")(*args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        try:
            return orig(self, *args, **kwargs)
        finally:
            if _OPEN_ATTR in self.__dict__:
                _close_step(self)
    return sample_tokens


# -- the API server: the request span's id ------------------------------------------------

def _choose_ids_of(provider) -> bool:
    """Makes the provider's id generator give a thread's next span the id
    chosen for it. The generator object itself is changed: every tracer made
    already holds it (the SDK keeps tracers by name)."""
    gen = getattr(provider, "id_generator", None)
    if gen is None:
        return False
    if getattr(gen, "_spanlet_chosen", False):
        return True
    drawn = gen.generate_span_id

    def generate_span_id() -> int:
        sid = getattr(_state, "span_id", 0)
        if sid:
            _state.span_id = 0
            return sid
        return drawn()

    try:
        gen.generate_span_id = generate_span_id
        gen._spanlet_chosen = True
    except AttributeError:          # a generator that takes no attributes: no chosen ids
        return False
    return True


def _wrap_do_tracing(orig):
    def do_tracing(self, engine_core_output, req_state, *args, **kwargs):
        sid = 0
        if not _broken:
            try:
                from opentelemetry import trace
                tid = trace_id_of(engine_core_output.trace_headers)
                if tid and _choose_ids_of(trace.get_tracer_provider()):
                    sid = request_span_id(tid, req_state.request_id, engine_core_output.trace_headers)
            except Exception as e:
                _step_aside("choosing the request span's id", e)
        _state.span_id = sid
        try:
            return orig(self, engine_core_output, req_state, *args, **kwargs)
        finally:
            _state.span_id = 0
    return do_tracing


# -- the API server: requests vLLM aborts ------------------------------------------------
#
# vLLM makes no llm_request for a request aborted before it finished (the
# client went away): the plugin makes it, so that the steps it took part in
# are kept on it. Each request's trace headers are kept on its RequestState
# (add_request); abort_requests ends those it takes away.

_HEADERS_ATTR = "_spanlet_trace_headers"
ABORTED = "spanlet.vllm.aborted"


def _wrap_add_request(orig):
    def add_request(self, request, *args, **kwargs):
        out = orig(self, request, *args, **kwargs)
        try:
            headers = getattr(request, "trace_headers", None)
            st = self.request_states.get(request.request_id) if headers else None
            if st is not None and trace_id_of(headers):
                setattr(st, _HEADERS_ATTR, headers)
        except Exception as e:
            _step_aside("noting a request's trace headers", e)
        return out
    return add_request


def _aborted_span(st, headers) -> None:
    import time

    from opentelemetry import trace
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    provider = trace.get_tracer_provider()
    tid = trace_id_of(headers)
    if not tid or not _choose_ids_of(provider):
        return
    arrival = getattr(getattr(st, "stats", None), "arrival_time", None) or time.time()
    _state.span_id = request_span_id(tid, st.request_id, headers)
    try:
        provider.get_tracer("spanlet.vllm").start_span(
            "llm_request", context=TraceContextTextMapPropagator().extract(headers), kind=SpanKind.SERVER,
            start_time=int(arrival * 1e9),
            attributes={"gen_ai.request.id": st.external_req_id, ABORTED: True}).end()
    finally:
        _state.span_id = 0


def _wrap_abort_requests(orig):
    def abort_requests(self, *args, **kwargs):
        before = None
        if not _broken and getattr(self, "tracing_enabled", False):
            before = {rid: st for rid, st in self.request_states.items() if hasattr(st, _HEADERS_ATTR)}
        out = orig(self, *args, **kwargs)
        if before:
            try:
                for rid, st in before.items():
                    if rid not in self.request_states:      # taken away: aborted
                        _aborted_span(st, getattr(st, _HEADERS_ATTR))
            except Exception as e:
                _step_aside("making an aborted request's span", e)
        return out
    return abort_requests


# -- the API server: the front end's own work, on the request's span ---------------------
#
# An HTTP request with a sampled traceparent gets, as it comes in (an ASGI
# middleware), a span id chosen for its llm_request and a span of its own,
# `spanlet.vllm.front_end`, the child of that id, current while the request
# is rendered (tokenized, its images and audio processed) until it is handed
# to the engine (`_get_trace_headers`, which also puts the chosen id into the
# trace headers that go to the engine and come back to do_tracing). The agent
# adds the front end's facts to its parent, llm_request, as the request's
# totals (kernel.request.*): it is exported, by vLLM's own provider, before
# llm_request is made.

_front = contextvars.ContextVar("spanlet_vllm_front_end", default=None)
_front_processor = None             # the span processor added to vLLM's provider, once


def _open_front_end(tid: int):
    """[span, context token, chosen llm_request id, handed on] or None."""
    global _front_processor
    from opentelemetry import context, trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

    provider = trace.get_tracer_provider()
    if not hasattr(provider, "add_span_processor"):
        return None                 # vLLM traces nothing (yet): no SDK provider
    _choose_ids_of(provider)        # before any tracer of ours exists
    if _front_processor is None:
        from spanlet.client import SpanletSpanProcessor
        _front_processor = SpanletSpanProcessor()
        provider.add_span_processor(_front_processor)
    sid = random.getrandbits(64) or 1
    parent = NonRecordingSpan(SpanContext(tid, sid, False, TraceFlags(TraceFlags.SAMPLED)))
    span = provider.get_tracer("spanlet.vllm").start_span(
        FRONT_END_SPAN_NAME, context=trace.set_span_in_context(parent), kind=SpanKind.INTERNAL)
    state = [span, context.attach(trace.set_span_in_context(span)), sid, False]
    _front.set(state)
    return state


def _end_front_end(state) -> None:
    span, token = state[0], state[1]
    if token is not None:
        from opentelemetry import context
        state[1] = None
        try:
            context.detach(token)
        finally:
            span.end()


class FrontEndMiddleware:
    """ASGI middleware of vLLM's app: an HTTP request's front end span."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        state = None
        if scope.get("type") == "http" and not _broken:
            try:
                for k, v in scope.get("headers", ()):
                    if k == b"traceparent":
                        tid = trace_id_of({"traceparent": v.decode("latin-1")})
                        state = _open_front_end(tid) if tid else None
                        break
            except Exception as e:
                _step_aside("starting a front end span", e)
        try:
            return await self.app(scope, receive, send)
        finally:
            if state is not None:
                _end_front_end(state)


def _wrap_init_entrypoints_middleware(orig):
    def init_entrypoints_middleware(args, app, *rest, **kwargs):
        out = orig(args, app, *rest, **kwargs)
        app.add_middleware(FrontEndMiddleware)
        return out
    return init_entrypoints_middleware


def _wrap_get_trace_headers(orig):
    async def _get_trace_headers(self, headers):
        out = await orig(self, headers)
        state = _front.get()
        if state is not None and out and not state[3]:
            state[3] = True         # the request's first engine request: llm_request gets the id
            try:
                out = {**out, SPAN_HEADER: f"{state[2]:016x}"}
            finally:
                _end_front_end(state)   # handed to the engine: the front end's work is done
        return out
    return _get_trace_headers


_WRAPPERS = {"schedule": _wrap_schedule, "execute_model": _wrap_execute_model,
             "sample_tokens": _wrap_sample_tokens, "do_tracing": _wrap_do_tracing,
             "_get_trace_headers": _wrap_get_trace_headers,
             "add_request": _wrap_add_request, "abort_requests": _wrap_abort_requests,
             "init_entrypoints_middleware": _wrap_init_entrypoints_middleware}


def _find(hooks=HOOKS) -> list[tuple[type, str, object]]:
    """Every hooked method, or ValueError naming the first one missing."""
    import importlib
    import multiprocessing
    api_server = multiprocessing.parent_process() is None   # engine core, workers: its children
    found = []
    for mod, cls, meth, front in hooks:
        if front and not api_server:
            continue
        try:
            module = importlib.import_module(mod)
            klass = module if cls is None else getattr(module, cls)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{mod}.{cls or meth} not found ({e})") from None
        fn = vars(klass).get(meth)
        if fn is None and "__getattr__" in vars(klass):
            pass                    # the class hands it on to what it wraps: hooked as its own
        elif not callable(fn):
            raise ValueError(f"{mod}.{cls}.{meth} not found")
        found.append((klass, meth, fn))
    return found


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point, called once in each of its
    processes: hooks the engine's scheduler, the workers and the API server's
    request span, or logs one line and steps aside."""
    if not enabled() or _patched:
        return
    try:
        import vllm
        version = getattr(vllm, "__version__", "?")
        found = _find()
    except Exception as e:
        log.warning("spanlet: this vLLM is not one the plugin knows (%s); no step spans, "
                    "serving goes on", e)
        return
    for klass, meth, fn in found:
        setattr(klass, meth, _WRAPPERS[meth](fn))
        _patched.append((klass, meth, fn))
    if "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" in os.environ:
        # the engine core and workers (vLLM hands them its endpoint): the marker
        # is mapped now, so the agent has attached to it before the first step
        try:
            _tracer()
        except Exception as e:
            _step_aside("making the step spans' tracer", e)
    log.info("spanlet: vLLM %s step spans on (SPANLET_VLLM=0 turns them off)", version)


def unregister() -> None:
    """Puts back what register() hooked (tests)."""
    global _broken, _worker_tracer, _front_processor
    while _patched:
        klass, meth, fn = _patched.pop()
        if fn is None:
            delattr(klass, meth)
        else:
            setattr(klass, meth, fn)
    _broken, _worker_tracer, _front_processor = False, None, None
