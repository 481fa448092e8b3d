"""The daemon's pipelines: the span path (spans in, joined, out) and the store
path; each is built, started and stopped by the daemon."""
