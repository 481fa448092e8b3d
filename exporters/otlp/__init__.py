"""OTLP: the trace receiver, the span and metric exporters, where they send
(upstream) and how (transport)."""
