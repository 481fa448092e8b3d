"""Batched steps for engine loops (continuous batching): one span per GPU step,
linked to the request spans it served, so that the agent gives each request
its share of the step's kernel facts (DESIGN.md, "Batched steps").

Any OpenTelemetry span with links does the same; this only saves writing the
links. The request's span context travels from the front end to the engine
as W3C trace context (a `traceparent` header or field, as vLLM carries its
trace headers)::

    # front end, inside the request's SERVER span
    engine.submit(prompt, trace_headers=spanlet.batch.request_headers())

    # engine loop
    with spanlet.batch.step(tracer, [(r.trace_headers, r.new_tokens) for r in batch]):
        run_model(batch)

Only the OpenTelemetry API is imported: nothing of the agent.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Mapping, Union

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

WEIGHT = "spanlet.weight"
STEP_SPAN_NAME = "spanlet.batch.step"

_PROPAGATOR = TraceContextTextMapPropagator()
# a request as the engine knows it: its span context, its span, or its trace headers
Request = Union[SpanContext, Span, Mapping[str, str]]


def request_headers(span: Span | None = None) -> dict[str, str]:
    """The W3C trace context (`traceparent`, `tracestate`) of `span`, or of the
    current span: what the front end hands to the engine with the request."""
    ctx = trace.set_span_in_context(span) if span is not None else None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def request_context(request: Request) -> SpanContext | None:
    """The span context of a request (a SpanContext, a Span, or headers holding
    `traceparent`); None when it holds no valid one."""
    if isinstance(request, SpanContext):
        ctx = request
    elif isinstance(request, Span):
        ctx = request.get_span_context()
    else:
        ctx = trace.get_current_span(_PROPAGATOR.extract(request)).get_span_context()
    return ctx if ctx.is_valid else None


def links(requests: Iterable[Request | tuple[Request, float]]) -> list[Link]:
    """One link per request with a valid context, with its weight
    (`spanlet.weight`, e.g. its tokens in the step) when one is given."""
    out = []
    for item in requests:
        weight = None
        if isinstance(item, tuple) and not isinstance(item, SpanContext):  # SpanContext is a tuple
            item, weight = item
        ctx = request_context(item)
        if ctx is None:
            continue
        out.append(Link(ctx, {WEIGHT: float(weight)} if weight is not None else None))
    return out


@contextlib.contextmanager
def step(tracer: trace.Tracer, requests: Iterable[Request | tuple[Request, float]],
         name: str = STEP_SPAN_NAME, attributes: Mapping | None = None,
         **start_kw) -> Iterator[Span]:
    """The step span, current while the step runs, linked to its requests.

    The OpenTelemetry SDK keeps at most OTEL_SPAN_LINK_COUNT_LIMIT links per
    span (128 by default): raise it above the engine's largest batch."""
    with tracer.start_as_current_span(name, links=links(requests), attributes=attributes,
                                      **start_kw) as span:
        yield span
