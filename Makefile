# spanlet: the two commands of the README, and the pieces they are made of.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup setup-image image run test wheel-check unit bench soak dump-bpf native clean demo demo-agent fuzz sanitize

setup:
	bash scripts/setup.sh

# The agent's container image, localhost/spanlet:<version> and :latest, in the
# local podman store (scripts/image.sh; podman, runc and mmdebstrap from
# scripts/setup.sh --image). Nothing is pulled from a container registry.
image: setup-image
	bash scripts/image.sh

setup-image:
	bash scripts/setup.sh --image

# Sets everything up, then runs the agent with its defaults (root needed).
run: setup
	$(VENV)/bin/spanlet run $(ARGS)

# The demo, in two shells: the agent with the demo's config (stand-in NVML,
# tensor pools, short windows), then the workload (DURATION seconds).
DURATION ?= 120
demo-agent: setup
	$(VENV)/bin/spanlet run --config agent/demo/agent.yaml $(ARGS)

demo: setup
	$(VENV)/bin/spanlet demo --duration $(DURATION) $(ARGS)

# Sets everything up, checks that a wheel built from the checkout installs and
# works, then runs the whole test suite (root needed for the kernel tier;
# SPANLET_REQUIRE_KERNEL=1 makes a kernel test that cannot run fail).
# The whole suite, the container test included: setup with the image's tools.
# A brief fuzz run (TEST_FUZZ_SECONDS a target) and the sanitizer run of the
# unit tier go first.
TEST_FUZZ_SECONDS ?= 5
test: setup-image wheel-check
	$(MAKE) fuzz FUZZ_SECONDS=$(TEST_FUZZ_SECONDS)
	$(MAKE) sanitize
	$(PY) -m pytest -ra $(PYTEST_ARGS)

# The wheel of HEAD, built from a clean copy, in fresh venvs: the client alone,
# then with the [agent] extra (scripts/wheel_check.sh).
wheel-check:
	bash scripts/wheel_check.sh

# The stand-in CUDA and NVML libraries of the demo (agent/demo/standin). The
# span marker is no target here: every build of the package compiles it.
native: agent/_native/standin/libnvidia-ml.so.1

agent/_native/standin/libnvidia-ml.so.1: agent/demo/standin/cuda.c agent/demo/standin/cuda_types.h agent/demo/standin/cudart.c agent/demo/standin/nvml.c agent/demo/standin/__init__.py
	$(PY) -m spanlet.demo.standin agent/_native/standin

unit:
	$(PY) -m pytest -ra tests/unit

# The native entry points that read outside bytes, fuzzed: one libFuzzer
# target a function (fuzz/*.c, embedding CPython), built with ASan and UBSan
# into build/fuzz, then fuzz/run.sh: each target's regressions, then
# FUZZ_SECONDS of fuzzing from its seed corpus (fuzz/corpus, written by
# fuzz/make_corpus.py); any finding fails. Root needed (wire_join_resource
# makes BPF maps); clang-16 and libclang-rt-16-dev from scripts/setup.sh.
FUZZ_SECONDS ?= 10
FUZZ_CC ?= clang-16
PYTHON_CONFIG ?= python3-config
FUZZ_CFLAGS := -g -O1 -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
FUZZ_TARGETS := $(patsubst fuzz/%.c,build/fuzz/%,$(wildcard fuzz/*.c))

fuzz: $(FUZZ_TARGETS)
	FUZZ_SECONDS=$(FUZZ_SECONDS) bash fuzz/run.sh

build/fuzz/%: fuzz/%.c fuzz/harness.h $(wildcard native/*.c)
	@mkdir -p build/fuzz
	$(FUZZ_CC) $(FUZZ_CFLAGS) $$($(PYTHON_CONFIG) --includes) $< -o $@ $$($(PYTHON_CONFIG) --embed --ldflags) -lm

# The native extensions built with ASan and UBSan, loaded in place of the
# package's own, under the unit tier; leaks reported (scripts/sanitize.sh;
# the tests it leaves out and why: tests/sanitize/leave_out.txt).
sanitize:
	bash scripts/sanitize.sh

bench: setup
	@for b in bench/*_bench.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# The 10-minute soak (RSS and CPU trend of the whole agent under steady load).
soak: setup
	$(PY) bench/soak.py $(ARGS)

dump-bpf:
	$(VENV)/bin/spanlet run --dump-bpf

clean:
	rm -rf $(VENV) build *.egg-info agent/_native agent/libspanlet_marker*.so agent/_wire*.so agent/_ring*.so
