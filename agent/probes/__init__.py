"""The kernel side of the agent: one loader per bpf/*.bpf.c program and what they
share (the base class, map readers, the ring-buffer reader, the node checks)."""
