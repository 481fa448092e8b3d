"""`spanlet demo`: a synthetic multimodal serving workload that lights up all
17 metrics of one node, run beside an agent started with agent/demo/agent.yaml
(`make demo-agent`). See agent/demo/run.py for what it starts and removes."""
