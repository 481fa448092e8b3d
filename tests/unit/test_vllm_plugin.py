"""spanlet.vllm against vLLM's shapes (the real vLLM runs in
tests/e2e/test_vllm.py): the links a scheduled step gets, the worker's step
span, the request span's chosen id, and stepping aside on moved internals."""

from __future__ import annotations

import logging
import sys
import types

import pytest
from opentelemetry import context, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from spanlet import vllm as plugin

TID = 0x0123456789ABCDEF0123456789ABCDEF
TP = f"00-{TID:032x}-1111111111111111-01"


class Request:
    def __init__(self, trace_headers):
        self.trace_headers = trace_headers


class SchedulerOutput:
    def __init__(self, tokens):
        self.num_scheduled_tokens = tokens


def fake_vllm(monkeypatch, missing: str = "") -> dict:
    """vLLM's modules and the classes the plugin hooks, as shaped in 0.32."""
    class Scheduler:
        def __init__(self, requests, plan):
            self.requests, self.plan = requests, plan

        def schedule(self, *args):
            return SchedulerOutput(dict(self.plan))

    class Worker:
        def __init__(self, seen):
            self.seen = seen

        def sample_tokens(self, grammar_output):
            self.seen.append(("sample", trace.get_current_span()))
            return "output"

    class WorkerWrapperBase:      # sample_tokens: handed on to its worker by __getattr__, as in 0.32
        def __init__(self, rpc_rank=0, sample=True):
            self.rpc_rank, self.sample, self.seen = rpc_rank, sample, []
            self.worker = Worker(self.seen)

        def execute_model(self, scheduler_output):
            self.seen.append(("execute", trace.get_current_span()))
            return None if self.sample else "output"

        def __getattr__(self, attr):
            return getattr(self.worker, attr)

    class OutputProcessor:
        tracing_enabled = True

        def __init__(self, provider):
            self.provider, self.request_states = provider, {}
            self.tracer = provider.get_tracer("vllm")   # made before any id is chosen, and kept

        def add_request(self, request, prompt, parent_req=None, request_index=0, queue=None):
            self.request_states[request.request_id] = types.SimpleNamespace(
                request_id=request.request_id, external_req_id=request.request_id.rsplit("-", 1)[0],
                stats=types.SimpleNamespace(arrival_time=1234.5))

        def abort_requests(self, request_ids, internal):
            for rid in request_ids:
                self.request_states.pop(rid, None)
            return list(request_ids)

        def do_tracing(self, engine_core_output, req_state, iteration_stats):
            ctx = TraceContextTextMapPropagator().extract(engine_core_output.trace_headers or {})
            self.tracer.start_span("llm_request", context=ctx).end()

    class BaseServing:
        async def _get_trace_headers(self, headers):
            return {"traceparent": headers["traceparent"]} if "traceparent" in headers else None

    def init_entrypoints_middleware(args, app, supported_tasks):
        app.middleware.append("cors")

    classes = {"Scheduler": Scheduler, "WorkerWrapperBase": WorkerWrapperBase,
               "OutputProcessor": OutputProcessor, "BaseServing": BaseServing}
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.32.0"))
    modules = {mod: types.ModuleType(mod) for mod, *_ in plugin.HOOKS}
    for mod, cls, meth, _ in plugin.HOOKS:
        if cls is None:
            if meth != missing:
                setattr(modules[mod], meth, init_entrypoints_middleware)
                classes[meth] = modules[mod]
        elif cls != missing:
            setattr(modules[mod], cls, classes[cls])
    for mod, m in modules.items():
        monkeypatch.setitem(sys.modules, mod, m)
    return classes


@pytest.fixture
def vllm(monkeypatch):
    monkeypatch.delenv(plugin.ENV, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1")
    classes = fake_vllm(monkeypatch)
    exp = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    monkeypatch.setattr(plugin, "_worker_tracer", provider.get_tracer("spanlet.vllm"))
    plugin.register()
    yield classes, exp
    plugin.unregister()
    assert "sample_tokens" not in vars(classes["WorkerWrapperBase"])   # put back as it was


def api_server_provider(monkeypatch):
    """(exporter, provider) of vLLM's API server: the global provider, kept in memory."""
    exp = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    return exp, provider


def test_the_request_span_id_is_derived_from_trace_and_request_and_never_zero():
    a = plugin.request_span_id(TID, "cmpl-1-0-abcdef12")
    assert a == plugin.request_span_id(TID, "cmpl-1-0-abcdef12") and 0 < a < 2 ** 64
    assert a != plugin.request_span_id(TID, "cmpl-1-0-abcdef13")
    assert a != plugin.request_span_id(TID + 1, "cmpl-1-0-abcdef12")
    assert plugin.trace_id_of({"traceparent": TP}) == TID
    assert plugin.trace_id_of({"traceparent": TP[:-2] + "00"}) == 0      # not sampled: no llm_request
    for bad in (None, {}, {"traceparent": "garbage"}, {"traceparent": TP.replace("0123", "zzzz")}):
        assert plugin.trace_id_of(bad) == 0


def test_a_scheduled_step_carries_a_weighted_link_per_traced_request(vllm):
    classes, _ = vllm
    reqs = {"r1": Request({"traceparent": TP}), "r2": Request(None), "r3": Request({"traceparent": TP})}
    out = classes["Scheduler"](reqs, {"r1": 7, "r2": 1, "r3": 1, "gone": 4}).schedule()
    assert getattr(out, plugin.LINKS_ATTR) == (
        (TID, plugin.request_span_id(TID, "r1"), 7), (TID, plugin.request_span_id(TID, "r3"), 1))
    out = classes["Scheduler"]({"r2": reqs["r2"]}, {"r2": 3}).schedule()
    assert not hasattr(out, plugin.LINKS_ATTR)       # no traced request: nothing to carry


@pytest.mark.parametrize("rank", [0, 1])
def test_the_worker_step_span_is_current_from_the_model_run_to_its_sampling(vllm, rank):
    classes, exp = vllm
    reqs = {"a": Request({"traceparent": TP}), "b": Request({"traceparent": TP})}
    out = classes["Scheduler"](reqs, {"a": 5, "b": 1}).schedule()
    w = classes["WorkerWrapperBase"](rpc_rank=rank)
    before = context.get_current()
    assert w.execute_model(out) is None
    assert w.sample_tokens(None) == "output"
    assert context.get_current() == before
    (step,) = exp.get_finished_spans()
    assert step.name == plugin.STEP_SPAN_NAME
    assert [s.get_span_context() for _, s in w.seen] == [step.get_span_context()] * 2
    assert [(l.context.trace_id, l.context.span_id, l.context.trace_flags.sampled) for l in step.links] == [
        (TID, plugin.request_span_id(TID, "a"), True), (TID, plugin.request_span_id(TID, "b"), True)]
    assert step.attributes[plugin.WEIGHTS] == (5, 1)       # each link's tokens, in link order
    assert step.attributes.get(plugin.SHARD) == (rank or None)
    assert step.attributes["spanlet.batch.tokens"] == 6


def test_a_step_with_its_output_at_once_or_without_traced_requests(vllm):
    classes, exp = vllm
    out = classes["Scheduler"]({"a": Request({"traceparent": TP})}, {"a": 2}).schedule()
    w = classes["WorkerWrapperBase"](sample=False)
    assert w.execute_model(out) == "output"
    assert len(exp.get_finished_spans()) == 1 and plugin._OPEN_ATTR not in vars(w)
    w.execute_model(SchedulerOutput({"a": 2}))            # no links: no span
    w.sample_tokens(None)
    assert len(exp.get_finished_spans()) == 1
    assert w.seen[-1][1] is trace.INVALID_SPAN or not w.seen[-1][1].get_span_context().is_valid


def test_the_request_span_gets_the_id_the_engine_linked_to(vllm, monkeypatch):
    classes, _ = vllm
    exp, provider = api_server_provider(monkeypatch)
    op = classes["OutputProcessor"](provider)
    op.do_tracing(types.SimpleNamespace(trace_headers={"traceparent": TP}),
                  types.SimpleNamespace(request_id="cmpl-x-0-12345678"), None)
    op.do_tracing(types.SimpleNamespace(trace_headers=None),           # no traceparent: its own id
                  types.SimpleNamespace(request_id="cmpl-y-0-12345678"), None)
    provider.get_tracer("other").start_span("other").end()             # other spans: their own ids
    first, second, other = exp.get_finished_spans()
    assert first.context.trace_id == TID and first.parent.span_id == 0x1111111111111111
    assert first.context.span_id == plugin.request_span_id(TID, "cmpl-x-0-12345678")
    assert second.context.span_id not in (0, first.context.span_id)
    assert other.context.span_id not in (0, first.context.span_id)


def test_a_vllm_whose_internals_moved_logs_one_line_and_is_left_alone(monkeypatch, caplog):
    monkeypatch.delenv(plugin.ENV, raising=False)
    classes = fake_vllm(monkeypatch, missing="WorkerWrapperBase")
    schedule = classes["Scheduler"].schedule
    with caplog.at_level(logging.WARNING, "vllm.spanlet"):
        plugin.register()
    try:
        assert classes["Scheduler"].schedule is schedule          # nothing hooked, not even what exists
        (rec,) = caplog.records
        assert "WorkerWrapperBase" in rec.getMessage() and "serving goes on" in rec.getMessage()
    finally:
        plugin.unregister()


def test_spanlet_vllm_0_turns_it_off(monkeypatch):
    monkeypatch.setenv(plugin.ENV, "0")
    classes = fake_vllm(monkeypatch)
    schedule = classes["Scheduler"].schedule
    plugin.register()
    assert classes["Scheduler"].schedule is schedule and not plugin._patched


def test_an_error_at_step_time_turns_the_steps_off_with_one_line_and_serving_goes_on(vllm, caplog):
    classes, exp = vllm

    class Broken:
        trace_headers = property(lambda self: 1 / 0)

    with caplog.at_level(logging.WARNING, "vllm.spanlet"):
        out = classes["Scheduler"]({"a": Broken()}, {"a": 1}).schedule()
        out2 = classes["Scheduler"]({"a": Request({"traceparent": TP})}, {"a": 1}).schedule()
    assert isinstance(out, SchedulerOutput) and not hasattr(out2, plugin.LINKS_ATTR)
    (rec,) = caplog.records
    assert "ZeroDivisionError" in rec.getMessage()


def test_the_front_end_span_is_the_chosen_llm_request_ids_child_until_the_request_goes_to_the_engine(
        vllm, monkeypatch):
    import asyncio

    classes, _ = vllm
    exp, provider = api_server_provider(monkeypatch)
    monkeypatch.setattr(plugin, "_front_processor", object())     # no marker hooks in this process
    app = types.SimpleNamespace(middleware=[], add_middleware=lambda cls: app.middleware.append(cls))
    sys.modules["vllm.entrypoints.launchers.app"].init_entrypoints_middleware(None, app, ())
    assert app.middleware == ["cors", plugin.FrontEndMiddleware]
    seen = {}

    async def handler(scope, receive, send):        # vLLM's app: render, then hand to the engine
        seen["rendering"] = trace.get_current_span()
        headers = await classes["BaseServing"]()._get_trace_headers({"traceparent": TP})
        seen["headers"] = headers
        seen["after"] = trace.get_current_span()
        seen["second"] = await classes["BaseServing"]()._get_trace_headers({"traceparent": TP})

    mw = plugin.FrontEndMiddleware(handler)
    asyncio.run(mw({"type": "http", "headers": [(b"traceparent", TP.encode())]}, None, None))
    (front,) = exp.get_finished_spans()
    assert front.name == plugin.FRONT_END_SPAN_NAME and seen["rendering"] is not None
    assert seen["rendering"].get_span_context() == front.get_span_context()
    assert not seen["after"].get_span_context().is_valid          # ended as the request left
    chosen = int(seen["headers"][plugin.SPAN_HEADER], 16)
    assert front.parent.span_id == chosen and front.parent.trace_id == TID
    assert not front.parent.is_remote                              # its facts go to llm_request
    assert plugin.SPAN_HEADER not in seen["second"]                # a second prompt: its own id
    # the engine links to the chosen id, do_tracing gives it to llm_request; a
    # parallel-sampling child other than the first gets an id of its own
    assert plugin.request_span_id(TID, "cmpl-1-0-abcd1234", seen["headers"]) == chosen
    assert plugin.request_span_id(TID, "0_cmpl-1-0-abcd1234", seen["headers"]) == chosen
    assert plugin.request_span_id(TID, "1_cmpl-1-0-abcd1234", seen["headers"]) == \
        plugin.request_span_id(TID, "1_cmpl-1-0-abcd1234")

    async def plain(scope, receive, send):
        seen["plain"] = trace.get_current_span()

    exp.clear()                                                    # no traceparent: nothing
    asyncio.run(plugin.FrontEndMiddleware(plain)({"type": "http", "headers": []}, None, None))
    assert not exp.get_finished_spans() and not seen["plain"].get_span_context().is_valid


def test_a_request_vllm_aborts_gets_its_llm_request_from_the_plugin(vllm, monkeypatch):
    classes, _ = vllm
    exp, provider = api_server_provider(monkeypatch)
    op = classes["OutputProcessor"](provider)
    chosen = {"traceparent": TP, plugin.SPAN_HEADER: "00000000000000ab"}
    for rid, headers in (("cmpl-a-0-11111111", chosen), ("cmpl-b-0-22222222", {"traceparent": TP}),
                         ("cmpl-c-0-33333333", None)):
        op.add_request(types.SimpleNamespace(request_id=rid, trace_headers=headers), "prompt")
    assert op.abort_requests(["cmpl-a-0-11111111", "cmpl-c-0-33333333"], True)
    (span,) = exp.get_finished_spans()           # the untraced one gets none, the living one none yet
    assert span.name == "llm_request" and span.kind == trace.SpanKind.SERVER
    assert span.context.span_id == 0xAB and span.parent.span_id == 0x1111111111111111
    assert span.attributes[plugin.ABORTED] is True and span.attributes["gen_ai.request.id"] == "cmpl-a-0"
    assert span.start_time == int(1234.5 * 1e9)
    op.abort_requests(["cmpl-b-0-22222222"], True)
    assert exp.get_finished_spans()[-1].context.span_id == plugin.request_span_id(TID, "cmpl-b-0-22222222")
