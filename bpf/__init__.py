"""The eBPF C sources of spanlet's probes, shipped as package data (read with importlib.resources)."""
