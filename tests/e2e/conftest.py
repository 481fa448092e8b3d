"""The end-to-end tier: whole agents (in process or as `spanlet run`), with
real Prometheus, OTLP clients and workloads around them."""
