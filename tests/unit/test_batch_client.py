"""spanlet.batch: the engine's step span, linked (OTel span links) to its
requests' span contexts with their weights, from W3C trace headers too."""

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spanlet import batch


def provider():
    exp = InMemorySpanExporter()
    p = TracerProvider()
    p.add_span_processor(SimpleSpanProcessor(exp))
    return p.get_tracer("t"), exp


def test_a_step_links_to_each_request_with_its_weight():
    tracer, exp = provider()
    with tracer.start_as_current_span("req-a", kind=trace.SpanKind.SERVER) as a:
        headers = batch.request_headers()          # what the front end sends on
    with tracer.start_as_current_span("req-b", kind=trace.SpanKind.SERVER) as b:
        pass
    c = tracer.start_span("req-c")
    assert headers["traceparent"].split("-")[2] == f"{a.get_span_context().span_id:016x}"
    with batch.step(tracer, [(headers, 3), (b.get_span_context(), 0.5), c,
                             {"traceparent": "garbage"}]) as s:
        assert trace.get_current_span() is s
    c.end()
    step = [x for x in exp.get_finished_spans() if x.name == batch.STEP_SPAN_NAME][0]
    got = [(l.context.trace_id, l.context.span_id, dict(l.attributes or {})) for l in step.links]
    assert got == [
        (a.get_span_context().trace_id, a.get_span_context().span_id, {"spanlet.weight": 3.0}),
        (b.get_span_context().trace_id, b.get_span_context().span_id, {"spanlet.weight": 0.5}),
        (c.get_span_context().trace_id, c.get_span_context().span_id, {})]
    # the request's trace is not the step's
    assert step.context.trace_id != a.get_span_context().trace_id


def test_headers_of_no_span_give_no_link():
    assert batch.request_headers() == {}
    assert batch.links([{}]) == []


def test_a_span_context_alone_is_a_request_without_weight():
    """SpanContext is a tuple (a namedtuple): alone it is a request, not (request, weight)."""
    ctx = trace.SpanContext(0xAB, 0xCD, is_remote=True, trace_flags=trace.TraceFlags(1))
    (link,) = batch.links([ctx])
    assert (link.context.trace_id, link.context.span_id, dict(link.attributes or {})) == (0xAB, 0xCD, {})
    (link,) = batch.links([(ctx, 2)])
    assert dict(link.attributes) == {"spanlet.weight": 2.0}
