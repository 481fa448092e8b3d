"""bench/gpu_check.py, the device check, where no GPU is: it is never run by
the tests, but it imports without PyTorch, its --help works, it refuses to
start without PyTorch with a clear message, and its table prints."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod     # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_help_and_defaults_without_torch():
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "torch.profiler" in r.stdout and "--replays" in r.stdout
    args = load().parse_args(["--set", "gpu.runtime_hooks=true", "--no-compile"])
    assert (args.iters, args.replays, args.no_compile, args.set) == (20, 10, True,
                                                                     ["gpu.runtime_hooks=true"])


def test_without_pytorch_or_a_gpu_it_says_so_and_stops():
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "gpu_check needs" in r.stderr


def test_table_lines_up_spanlet_and_the_profiler(capsys):
    mod = load()
    mod.print_table([mod.Region("CUDA graph replay", graph_launches=10, graph_kernels=30,
                                profiler_kernels=30, syncs=1, sync_wait_ms=1.5, sync_wall_ms=1.6)])
    line = capsys.readouterr().out.splitlines()[1].split()
    assert line[-8:] == ["0", "10", "30", "30", "30", "1", "1.50", "1.60"]
