"""`spanlet demo`: drives a synthetic multimodal serving workload for a bounded
time, then removes everything it made.

What it makes (fixed names, so that a demo killed half-way is cleaned up by
the next one):

- network namespace `spanlet-demo`, joined to this one by the veth pair
  spldemo0 (here, 169.254.77.1/30) / spldemo1 (there, 169.254.77.2/30); the
  agent's TC classifier attaches to spldemo0 as to any new interface, as it
  would to a pod's veth;
- tensor pools under /dev/shm/tensor_pool/spanlet-demo/ (weights, kv, and
  scratch, a file that is no pool);
- five worker processes (agent/demo/worker.py): one serving worker per
  modality, listening inside the namespace, and one rogue;
- an LLM server of two processes: an asyncio HTTP front end listening inside
  the namespace (agent/demo/frontend.py) and a separate engine with
  continuous batching (agent/demo/engine.py): each engine step is a span
  linked to the front end's request spans it served;
- traffic from here into the namespace: HTTP POSTs with `traceparent` to each
  worker at a rate that rises and falls, streamed completions from the LLM
  front end (LLM_CLIENTS clients, prompts and lengths that vary), and RTP
  audio (PT 0, 8 kHz) and video (PT 96, 90 kHz) streams with bursts of jitter.

Progress is printed every --progress seconds; Ctrl-C or SIGTERM ends early.
At the end it checks that no namespace, interface, pool file or process of
its own is left and says so.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from spanlet.demo import net, standin

NETNS = "spanlet-demo"
HOST_IF, NS_IF = "spldemo0", "spldemo1"
HOST_IP, NS_IP = "169.254.77.1", "169.254.77.2"
POOL_PARENT = Path("/dev/shm/tensor_pool")
POOL_DIR = POOL_PARENT / "spanlet-demo"
PARENT_MARK = ".made-by-spanlet-demo"   # in POOL_PARENT when a demo made that folder
TMP_PREFIX = "spanlet-demo-"             # a demo's folder for logs, its engine's socket, libraries built
OWNER_FILE = "owner.pid"                 # in it: the demo's pid, so that a later demo knows it is left
POOLS = {"weights": 4 << 20, "kv": 2 << 20, "scratch": 64 << 10}
HTTP_PORTS = {"text": 8101, "image": 8102, "audio": 8103, "video": 8104}
LLM_PORT = 8100
LLM_CLIENTS = 6
LLM = ("engine", "frontend")     # the LLM server's processes, started in this order
RTP_PORTS = {"audio": 5004, "video": 5006}
CONTENT = {"text": ("application/json", 512), "image": ("image/jpeg", 48 << 10),
           "audio": ("audio/wav", 16 << 10), "video": ("video/mp4", 96 << 10)}
BUILT_LIBS = Path(__file__).resolve().parents[1] / "_native" / "standin"
READY_TIMEOUT_S = 60.0


class DemoError(Exception):
    pass


@dataclass
class Counts:
    requests: int = 0
    failed: int = 0
    rtp: int = 0
    llm_requests: int = 0
    llm_failed: int = 0
    llm_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_error: str = ""

    def add(self, **kw) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)


class Demo:
    def __init__(self, duration_s: float, otlp_endpoint: str, rate: float,
                 progress_s: float = 10.0, seed: int | None = None, say=print,
                 lib_dir: Path | None = None):
        self.duration_s = duration_s
        self.otlp_endpoint = otlp_endpoint
        self.rate = rate
        self.progress_s = progress_s
        self.rng = random.Random(seed)
        self.say = say
        self.stop = threading.Event()
        self.counts = Counts()
        self.workers: dict[str, subprocess.Popen] = {}
        self.tmp: Path | None = None
        self.lib_dir = lib_dir or BUILT_LIBS
        self.own_libs = lib_dir is None

    # -- set up ------------------------------------------------------------------
    def check(self) -> None:
        if os.geteuid() != 0:
            raise DemoError("the demo makes a network namespace and /dev/shm pools: run it as root")
        if shutil.which("ip") is None:
            raise DemoError("'ip' (iproute2) not found: run `make setup`")

    def agent_listening(self) -> bool:
        u = urlsplit(self.otlp_endpoint)
        try:
            with socket.create_connection((u.hostname or "127.0.0.1", u.port or 4317), timeout=1):
                return True
        except OSError:
            return False

    def remove_leftovers(self) -> list[str]:
        """What an earlier demo left (killed before its clean-up), removed."""
        removed = []
        if net.netns_exists(NETNS):
            net.run("ip", "netns", "del", NETNS, check=False)
            removed.append(f"network namespace {NETNS}")
        if net.link_exists(HOST_IF):
            net.run("ip", "link", "del", HOST_IF, check=False)
            removed.append(f"interface {HOST_IF}")
        if POOL_DIR.exists():
            shutil.rmtree(POOL_DIR, ignore_errors=True)
            removed.append(str(POOL_DIR))
        if _remove_pool_parent():
            removed.append(str(POOL_PARENT))
        for folder in sorted(Path(tempfile.gettempdir()).glob(TMP_PREFIX + "*")):
            if folder != self.tmp and _owner_gone(folder):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(str(folder))
        return removed

    def make_network(self) -> None:
        ip = net.run
        ip("ip", "netns", "add", NETNS)
        ip("ip", "netns", "exec", NETNS, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1")
        ip("ip", "netns", "exec", NETNS, "sysctl", "-q", "-w", "net.ipv6.conf.default.disable_ipv6=1")
        ip("ip", "-n", NETNS, "link", "set", "lo", "up")
        ip("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF, "netns", NETNS)
        ip("sysctl", "-q", "-w", f"net.ipv6.conf.{HOST_IF}.disable_ipv6=1", check=False)
        ip("ip", "addr", "add", f"{HOST_IP}/30", "dev", HOST_IF)
        ip("ip", "-n", NETNS, "addr", "add", f"{NS_IP}/30", "dev", NS_IF)
        ip("ip", "link", "set", HOST_IF, "up")
        ip("ip", "-n", NETNS, "link", "set", NS_IF, "up")

    def make_pools(self) -> None:
        if not POOL_PARENT.exists():
            POOL_PARENT.mkdir(mode=0o755)
            (POOL_PARENT / PARENT_MARK).touch()
        POOL_DIR.mkdir(mode=0o755)
        for name, size in POOLS.items():
            with open(POOL_DIR / name, "wb") as f:
                f.truncate(size)

    def find_libs(self) -> None:
        if standin.built(self.lib_dir):
            return
        if not self.own_libs:
            raise DemoError(f"--lib-dir {self.lib_dir}: the stand-in libraries are not all there "
                            f"({standin.DRIVER}, {standin.RUNTIME}, {standin.NVML})")
        self.say(f"demo: stand-in CUDA/NVML libraries not built ({self.lib_dir}); building them "
                 "in a temporary folder (`make native` builds them once)")
        self.lib_dir = standin.build_all(self._tmp() / "lib")

    def _tmp(self) -> Path:
        if self.tmp is None:
            self.tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX))
            (self.tmp / OWNER_FILE).write_text(str(os.getpid()))
        return self.tmp

    def start_workers(self) -> None:
        common = ["--otlp-endpoint", self.otlp_endpoint, "--parent", str(os.getpid())]
        base = ["spanlet.demo.worker", "--netns", NETNS, "--address", NS_IP, "--lib-dir",
                str(self.lib_dir), "--pool-dir", str(POOL_DIR), *common]
        engine_socket = str(self._tmp() / "engine.sock")
        deadline = time.monotonic() + READY_TIMEOUT_S
        # the engine first: the front end connects to it
        self._spawn("engine", ["spanlet.demo.engine", "--socket", engine_socket, "--lib-dir",
                               str(self.lib_dir), *common], deadline)
        self._spawn("frontend", ["spanlet.demo.frontend", "--netns", NETNS, "--address", NS_IP,
                                 "--port", str(LLM_PORT), "--engine-socket", engine_socket, *common], None)
        for modality in [*HTTP_PORTS, "rogue"]:
            argv = [*base, "--modality", modality, "--seed", str(self.rng.randrange(1 << 30))]
            if modality in HTTP_PORTS:
                argv += ["--port", str(HTTP_PORTS[modality])]
            if modality in RTP_PORTS:
                argv += ["--rtp-port", str(RTP_PORTS[modality])]
            self._spawn(modality, argv, None)
        for name, proc in self.workers.items():
            if name != "engine" and _readline(proc, deadline - time.monotonic()) != "ready":
                raise DemoError(f"{name} worker did not start: {self._log_tail(name)}")

    def _spawn(self, name: str, argv: list[str], ready_by: float | None) -> None:
        """Start `python -m ARGV` as worker `name`; with `ready_by`, wait for its "ready"."""
        log = open(self._tmp() / f"{name}.log", "wb")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH"))
            if p))
        self.workers[name] = subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.PIPE,
                                              stderr=log, stdin=subprocess.DEVNULL, env=env)
        log.close()
        if ready_by is not None and _readline(self.workers[name], ready_by - time.monotonic()) != "ready":
            raise DemoError(f"{name} worker did not start: {self._log_tail(name)}")

    def _log_tail(self, modality: str) -> str:
        try:
            text = (self._tmp() / f"{modality}.log").read_text(errors="replace").strip()
        except OSError:
            return "(no log)"
        return text[-2000:] or "(no output)"

    # -- traffic -----------------------------------------------------------------
    def _rate(self, t: float) -> float:
        """Requests/s per modality: rises and falls over a minute."""
        return max(0.2, self.rate / 4 * (1.0 + 0.8 * math.sin(t / 10.0)))

    def http_client(self, modality: str, seed: int) -> None:
        rng = random.Random(seed)
        ctype, size = CONTENT[modality]
        t0 = time.monotonic()
        while not self.stop.is_set():
            traceparent = f"00-{rng.randbytes(16).hex()}-{rng.randbytes(8).hex()}-01"
            body = rng.randbytes(size // 2) * 2
            conn = http.client.HTTPConnection(NS_IP, HTTP_PORTS[modality], timeout=15)
            try:
                conn.request("POST", f"/v1/{modality}/infer", body=body,
                             headers={"Content-Type": ctype, "traceparent": traceparent})
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    raise OSError(f"HTTP {resp.status}")
                self.counts.add(requests=1)
            except OSError as e:
                self.counts.add(requests=1, failed=1)
                self.counts.last_error = f"{modality}: {e}"
            finally:
                conn.close()
            self.stop.wait(rng.expovariate(self._rate(time.monotonic() - t0)))

    def llm_client(self, seed: int) -> None:
        """Completions from the LLM front end, each read as it streams: prompts
        of 16 to 600 tokens, 2 to 48 tokens out, so that the engine's batch
        changes between steps."""
        rng = random.Random(seed)
        t0 = time.monotonic()
        while not self.stop.is_set():
            traceparent = f"00-{rng.randbytes(16).hex()}-{rng.randbytes(8).hex()}-01"
            body = json.dumps({"prompt_tokens": rng.randint(16, 600),
                               "max_tokens": rng.randint(2, 48)}).encode()
            conn = http.client.HTTPConnection(NS_IP, LLM_PORT, timeout=15)
            try:
                conn.request("POST", "/v1/completions", body=body,
                             headers={"Content-Type": "application/json", "traceparent": traceparent})
                resp = conn.getresponse()
                if resp.status != 200:
                    raise OSError(f"HTTP {resp.status}")
                tokens, done = 0, False
                while line := resp.readline():     # one line per token, as the engine makes it
                    m = json.loads(line)
                    done = done or bool(m.get("done"))
                    tokens += "token" in m
                if not done:
                    raise OSError(f"the stream ended after {tokens} tokens")
                self.counts.add(llm_requests=1, llm_tokens=tokens)
            except (OSError, ValueError) as e:
                self.counts.add(llm_requests=1, llm_failed=1)
                self.counts.last_error = f"llm: {e}"
            finally:
                conn.close()
            self.stop.wait(rng.expovariate(self._rate(time.monotonic() - t0)))

    def rtp_sender(self, seed: int) -> None:
        """Audio: one 20 ms packet of 160 samples; video: a frame of three
        packets every 40 ms. Every 15 s a 'congestion' holds both for 80 to
        160 ms, then the held packets go out at once: late packets."""
        rng = random.Random(seed)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        streams = {  # modality: [payload type, seq, ts, ts step, ssrc, period s, packets per tick]
            "audio": [0, rng.randrange(65536), rng.randrange(1 << 32), 160, rng.randrange(1 << 32), 0.020, 1],
            "video": [96, rng.randrange(65536), rng.randrange(1 << 32), 3600, rng.randrange(1 << 32), 0.040, 3],
        }
        t0 = time.monotonic()
        due = {m: t0 for m in streams}
        next_hold = t0 + 15.0
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                if now >= next_hold:
                    self.stop.wait(rng.uniform(0.08, 0.16))
                    next_hold = time.monotonic() + 15.0
                    continue
                for modality, s in streams.items():
                    if now < due[modality]:
                        continue
                    pt, seq, ts, step, ssrc, period, per_tick = s
                    for k in range(per_tick):
                        marker = 0x80 if k == per_tick - 1 and modality == "video" else 0
                        hdr = struct.pack("!BBHII", 0x80, marker | pt, seq & 0xFFFF, ts & 0xFFFFFFFF, ssrc)
                        sock.sendto(hdr + b"\x55" * (160 if modality == "audio" else 1000),
                                    (NS_IP, RTP_PORTS[modality]))
                        seq += 1
                    s[1], s[2] = seq, ts + step
                    due[modality] += period * rng.uniform(0.9, 1.1)
                    self.counts.add(rtp=per_tick)
                self.stop.wait(max(0.0, min(due.values()) - time.monotonic()))
        finally:
            sock.close()

    # -- the whole run -------------------------------------------------------------
    def run(self) -> int:
        self.check()
        for what in self.remove_leftovers():
            self.say(f"demo: removed {what}, left by an earlier demo")
        if not self.agent_listening():
            self.say(f"demo: no agent is receiving OTLP at {self.otlp_endpoint}; the workload runs, "
                     "but nothing records it. Start one in another shell: make demo-agent")
        threads: list[threading.Thread] = []
        try:
            self.find_libs()
            self.make_network()
            self.make_pools()
            self.start_workers()
            self.say(f"demo: {len(HTTP_PORTS)} serving workers, an LLM front end and engine, and a "
                     f"rogue worker up in namespace {NETNS}; traffic for {self.duration_s:.0f} s")
            for modality in HTTP_PORTS:
                threads.append(threading.Thread(target=self.http_client, name=f"http-{modality}",
                                                args=(modality, self.rng.randrange(1 << 30)), daemon=True))
            for k in range(LLM_CLIENTS):
                threads.append(threading.Thread(target=self.llm_client, name=f"llm-{k}",
                                                args=(self.rng.randrange(1 << 30),), daemon=True))
            threads.append(threading.Thread(target=self.rtp_sender, name="rtp",
                                            args=(self.rng.randrange(1 << 30),), daemon=True))
            for t in threads:
                t.start()
            start = time.monotonic()
            end = start + self.duration_s
            while not self.stop.wait(max(0.0, min(self.progress_s, end - time.monotonic()))):
                now = time.monotonic()
                c = self.counts
                self.say(f"demo: {now - start:5.0f}/{self.duration_s:.0f} s  requests {c.requests} "
                         f"(failed {c.failed})  LLM completions {c.llm_requests} (failed {c.llm_failed}, "
                         f"tokens {c.llm_tokens})  RTP packets {c.rtp}")
                if now >= end:
                    break
                for modality, proc in self.workers.items():
                    if proc.poll() is not None and modality != "rogue":
                        raise DemoError(f"{modality} worker exited ({proc.returncode}): "
                                        f"{self._log_tail(modality)}")
        finally:
            self.stop.set()
            for t in threads:
                t.join(20)
            results = self.stop_workers()
            self.teardown()
        return self.report(results)

    def stop_workers(self) -> dict[str, str]:
        results = {}
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for modality, proc in self.workers.items():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            out = proc.stdout.read().decode(errors="replace").split() if proc.stdout else []
            proc.stdout and proc.stdout.close()
            if proc.returncode == -signal.SIGKILL and modality == "rogue":
                results[modality] = "killed by the sandbox (enforce mode)"
            elif proc.returncode != 0:
                results[modality] = f"exited {proc.returncode}: {self._log_tail(modality)}"
            else:
                results[modality] = " ".join(out[out.index("ready") + 1:] if "ready" in out else out)
        return results

    def teardown(self) -> None:
        if net.netns_exists(NETNS):
            net.run("ip", "netns", "del", NETNS, check=False)  # takes the veth pair with it
        if net.link_exists(HOST_IF):
            net.run("ip", "link", "del", HOST_IF, check=False)
        shutil.rmtree(POOL_DIR, ignore_errors=True)
        _remove_pool_parent()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def leftovers(self) -> list[str]:
        left = []
        if net.netns_exists(NETNS):
            left.append(f"network namespace {NETNS}")
        if net.link_exists(HOST_IF):
            left.append(f"interface {HOST_IF}")
        if POOL_DIR.exists():
            left.append(str(POOL_DIR))
        if (POOL_PARENT / PARENT_MARK).exists():
            left.append(str(POOL_PARENT))
        left += [f"{m} worker (pid {p.pid})" for m, p in self.workers.items() if p.poll() is None]
        if self.tmp is not None and self.tmp.exists():
            left.append(str(self.tmp))
        return left

    def report(self, results: dict[str, str]) -> int:
        c = self.counts
        self.say(f"demo: done: {c.requests} requests ({c.failed} failed), {c.llm_requests} LLM "
                 f"completions ({c.llm_failed} failed, {c.llm_tokens} tokens streamed), {c.rtp} RTP packets")
        for modality, what in results.items():
            self.say(f"demo:   {modality} worker: {what}")
        if c.failed:
            self.say(f"demo: last request error: {c.last_error}")
        left = self.leftovers()
        self.say("demo: left behind: " + (", ".join(left) if left else "nothing"))
        return 1 if left or c.requests == 0 or c.failed == c.requests or \
            c.llm_requests == 0 or c.llm_failed == c.llm_requests else 0


def _remove_pool_parent() -> bool:
    """The pools' parent folder, if a demo made it and nothing else is in it."""
    try:
        if {p.name for p in POOL_PARENT.iterdir()} != {PARENT_MARK}:
            return False
        (POOL_PARENT / PARENT_MARK).unlink()
        POOL_PARENT.rmdir()
        return True
    except OSError:
        return False  # gone already, or something else put files there meanwhile: theirs


def _owner_gone(folder: Path) -> bool:
    """Whether the demo that made this temporary folder has ended (killed before
    its clean-up): its pid, written in the folder, names no process. A folder
    without that file is not judged (a demo between making it and writing it)."""
    try:
        if folder.is_symlink() or folder.stat().st_uid != os.getuid():
            return False
        pid = int((folder / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _readline(proc: subprocess.Popen, timeout_s: float) -> str:
    """One line of a worker's stdout, or "" at its end or the timeout."""
    fd = proc.stdout.fileno()
    buf = b""
    deadline = time.monotonic() + max(0.0, timeout_s)
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return ""
        ch = os.read(fd, 1)
        if not ch:
            return ""
        buf += ch
    return buf.decode(errors="replace").strip()


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run a synthetic multimodal serving workload beside the agent")
    p.add_argument("--duration", type=float, default=120.0, metavar="S",
                   help="seconds of traffic (default 120)")
    p.add_argument("--rate", type=float, default=8.0, metavar="RPS",
                   help="mean HTTP requests/s over the four modality workers (default 8); each of "
                        "the LLM clients asks for completions at a quarter of it")
    p.add_argument("--otlp-endpoint", default="http://127.0.0.1:4317",
                   help="the agent's OTLP/gRPC receiver (default http://127.0.0.1:4317)")
    p.add_argument("--progress", type=float, default=10.0, metavar="S",
                   help="seconds between progress lines (default 10)")
    p.add_argument("--seed", type=int, help="seed of the workload's randomness")
    p.add_argument("--lib-dir", type=Path, metavar="DIR",
                   help="the stand-in CUDA/NVML libraries to load (default: those `make native` "
                        "built, or a fresh build)")


def main(args: argparse.Namespace) -> int:
    if not 0 < args.duration <= 24 * 3600:
        print("spanlet demo: --duration must be in (0, 86400] seconds", file=sys.stderr)
        return 2
    if not 0 < args.rate <= 1000:
        print("spanlet demo: --rate must be in (0, 1000] requests/s", file=sys.stderr)
        return 2
    demo = Demo(args.duration, args.otlp_endpoint, args.rate, args.progress, args.seed,
                say=lambda s: print(s, flush=True), lib_dir=args.lib_dir)
    stop = demo.stop.set
    signal.signal(signal.SIGINT, lambda *_: stop())
    signal.signal(signal.SIGTERM, lambda *_: stop())
    try:
        return demo.run()
    except (DemoError, standin.BuildError, subprocess.CalledProcessError, OSError) as e:
        detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) and e.stderr else ""
        print(f"spanlet demo: {e}{': ' + detail if detail else ''}", file=sys.stderr)
        left = demo.leftovers()
        if left:
            print("spanlet demo: left behind: " + ", ".join(left), file=sys.stderr)
        return 1
