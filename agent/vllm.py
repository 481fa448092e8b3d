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
its span id is chosen, not drawn: both sides derive it from what both know,
the trace id of the request's `traceparent` and vLLM's request id
(`request_span_id`). The API server's `OutputProcessor.do_tracing` makes the
span with that id; the engine's `Scheduler.schedule` puts the links of the
step it scheduled, (trace id, that span id, tokens scheduled), on the
`SchedulerOutput`, which reaches every worker; the worker
(`WorkerWrapperBase.execute_model` to `sample_tokens`) makes the step span,
current in its thread while the model runs, so the step's facts (GPU launches,
syncs, copies; CPU, run queue, blocked time) are its own. The links point at
the real span: a trace viewer follows them too.

With tensor parallelism every rank makes its step span; ranks other than 0
carry `spanlet.batch.shard` (their rank), and the agent counts a step once
while adding every rank's facts to the shares.

A vLLM whose internals moved (a class or method missing) makes the plugin log
one line and step aside: nothing is patched then. Any error at step time
turns the step spans off with one line; serving goes on.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading

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
# the places the plugin hooks, as (module, class, method)
HOOKS = (
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("vllm.v1.worker.worker_base", "WorkerWrapperBase", "execute_model"),
    # (0.32: not its own method, handed on to the worker by its __getattr__)
    ("vllm.v1.worker.worker_base", "WorkerWrapperBase", "sample_tokens"),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "do_tracing"),
)

_state = threading.local()          # .span_id: the id the next span of this thread gets
_broken = False
_worker_tracer = None               # the workers' tracer, made on their first traced step
_patched: list[tuple[type, str, object]] = []
_links: dict[int, object] = {}      # request span id → its Link, in the workers
_LINKS_CACHED = 65536


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def request_span_id(trace_id: int, request_id: str) -> int:
    """The span id of a request's `llm_request` span: 8 bytes of BLAKE2b over
    its trace id and vLLM's (internal) request id; never 0."""
    h = hashlib.blake2b(trace_id.to_bytes(16, "big") + request_id.encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") or 1


def trace_id_of(headers) -> int:
    """The trace id of a sampled W3C `traceparent` in headers, 0 if none."""
    tp = headers.get("traceparent") if headers else None
    if not tp or len(tp) < 55 or tp[2] != "-" or tp[35] != "-" or tp[52] != "-":
        return 0
    try:
        tid, flags = int(tp[3:35], 16), int(tp[53:55], 16)
    except ValueError:
        return 0
    return tid if flags & 1 else 0


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
            ids = (tid, request_span_id(tid, rid)) if tid else ()
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

class _ChosenIds:
    """An IdGenerator that gives the next span of a thread the id chosen for it."""

    def __init__(self, inner):
        self.inner = inner

    def generate_span_id(self) -> int:
        sid = getattr(_state, "span_id", 0)
        if sid:
            _state.span_id = 0
            return sid
        return self.inner.generate_span_id()

    def generate_trace_id(self) -> int:
        return self.inner.generate_trace_id()

    def __getattr__(self, name):       # the rest of the SDK's IdGenerator (is_trace_id_random, ...)
        return getattr(self.inner, name)


def _choose_ids_of(provider) -> bool:
    gen = getattr(provider, "id_generator", None)
    if gen is None:
        return False
    if not isinstance(gen, _ChosenIds):
        provider.id_generator = _ChosenIds(gen)
    return True


def _wrap_do_tracing(orig):
    def do_tracing(self, engine_core_output, req_state, *args, **kwargs):
        sid = 0
        if not _broken:
            try:
                from opentelemetry import trace
                tid = trace_id_of(engine_core_output.trace_headers)
                if tid and _choose_ids_of(trace.get_tracer_provider()):
                    sid = request_span_id(tid, req_state.request_id)
            except Exception as e:
                _step_aside("choosing the request span's id", e)
        _state.span_id = sid
        try:
            return orig(self, engine_core_output, req_state, *args, **kwargs)
        finally:
            _state.span_id = 0
    return do_tracing


_WRAPPERS = {"schedule": _wrap_schedule, "execute_model": _wrap_execute_model,
             "sample_tokens": _wrap_sample_tokens, "do_tracing": _wrap_do_tracing}


def _find(hooks=HOOKS) -> list[tuple[type, str, object]]:
    """Every hooked method, or ValueError naming the first one missing."""
    import importlib
    found = []
    for mod, cls, meth in hooks:
        try:
            klass = getattr(importlib.import_module(mod), cls)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{mod}.{cls} not found ({e})") from None
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
    global _broken, _worker_tracer
    while _patched:
        klass, meth, fn = _patched.pop()
        if fn is None:
            delattr(klass, meth)
        else:
            setattr(klass, meth, fn)
    _broken, _worker_tracer = False, None
