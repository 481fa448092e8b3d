"""The mmap sandbox probe: policy.py compiles the config into its maps,
procfs.py sweeps /proc behind it, probe.py loads and drives bpf/mmap_sandbox.bpf.c."""
