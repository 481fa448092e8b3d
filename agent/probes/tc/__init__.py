"""The TC classifier probe: attach.py hangs it on the interfaces, flows.py turns
its per-flow maps into totals and JSS, probe.py loads and drives bpf/tc_classify.bpf.c."""
