"""spanlet: per-node eBPF observability agent for multimodal model serving."""

__version__ = "0.1.0"
