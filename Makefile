# diffusion-aot: export -> engines -> runners.  `make engines` and `make test` need only Python.
MODEL     ?= sd3-tiny
TARGET    ?= ort
PRECISION ?= fp32
PROMPT    ?= a photo of a cat
OUT       ?= out.png
IMAGE_ARGS ?=
ENGINES_ARGS ?=
IMAGE_SIZE ?=
FRAMES    ?=
PYTHON    ?= python3

VENV := .venv
PY   := $(VENV)/bin/python
# Registry names build into build/<name>; a folder path builds into build/<folder's basename>.
# IMAGE_SIZE=MIN,OPT,MAX (pixels) overrides the image range the engines are built for; FRAMES=MIN,OPT,MAX a
# video model's frame range.
NAME := $(notdir $(patsubst %/,%,$(MODEL)))
BUILD := build/$(NAME)
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)

BENCH_ARGS ?=
# `make test` runs the suite on this many processes (tests/conftest.py groups what shares builds).
TEST_WORKERS ?= 2

.PHONY: venv lock upgrade-lock optimum-venv optimum-intel-venv export engines image test test-fast bench serve-bench fullsize-caches scale-check clean
venv: $(VENV)/.installed

# constraints.txt is the lock: the exact versions CI tested (`make lock` writes it from the ranges in
# pyproject.toml). Every install goes through it, so a fresh machine gets what CI ran.
# A machine without an NVIDIA GPU gets the small CPU build of torch first, so nothing pulls a CUDA build.
ifeq ($(HAS_GPU),1)
EXTRAS := build,gpu,dev
else
EXTRAS := build,cpu,dev
TORCH_CPU := torch==2.13.0
endif
define install_project  # $(1): the venv; $(2): extra pip flags
	$(1)/bin/python -m pip install -q $(2) --upgrade pip
	$(if $(TORCH_CPU),$(1)/bin/python -m pip install -q $(2) $(TORCH_CPU))
	# setuptools warns about every editable install (a folder named like the package): expected here.
	PYTHONWARNINGS=ignore $(1)/bin/python -m pip install -q $(2) -e '.[$(EXTRAS)]'
	# The real CLIP BPE table ships in this wheel; its deps (torchvision) are not needed.
	# Triton's server ships in nvidia-pytriton, whose numpy<2 pin is for its Python API (not used).
	$(1)/bin/python -m pip install -q $(2) --no-deps open-clip-torch nvidia-pytriton
	# The venv the Triton Python backend runs models in: numpy 1 (runners/serving/server.py).
	$(1)/bin/python -c "from runners.serving.server import stub_environment; stub_environment(install=True)"
endef

$(VENV)/.installed: pyproject.toml Makefile constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(call install_project,$(VENV),-c constraints.txt)
	touch $@

# The newest versions pyproject.toml's ranges allow, resolved in a fresh venv, become the lock.
LOCK_VENV := .venv-lock
lock:
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(call install_project,$(LOCK_VENV),)
	{ echo "# The versions CI tested: written by 'make lock' (CPU machine, $$($(LOCK_VENV)/bin/python -V)); do not edit."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all --exclude-editable | grep -v '^diffusion-aot' | sed 's/+cpu$$//'; \
	} > constraints.txt.tmp && mv constraints.txt.tmp constraints.txt
	rm -rf $(LOCK_VENV)

# Moving to new releases (a new onnxruntime, say) is one deliberate step: a new lock, then the suite on it.
upgrade-lock: lock
	$(MAKE) test

export: venv
	$(PY) -m export $(MODEL) --out $(BUILD) --reuse-from $(dir $(BUILD)) $(if $(IMAGE_SIZE),--image-size $(IMAGE_SIZE)) \
		$(if $(FRAMES),--frames $(FRAMES))

ENGINES := $(PY) -m engines $(BUILD) --target $(TARGET) --precision $(PRECISION) $(ENGINES_ARGS)
engines: export
	$(ENGINES)

# The folder the engines' options name (ENGINES_ARGS="--ov-shapes dynamic": openvino-bf16-dynamic).
image: engines
	$(PY) -m runners "$$($(ENGINES) --print-artifact)" --prompt "$(PROMPT)" --out $(OUT) $(IMAGE_ARGS)

# --max-worker-restart=0: a worker that dies (a native crash) ends the run, named. With a restart,
# xdist's loadgroup hands the crashed test to the new worker, which rebuilds its fixtures and dies again.
test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --max-worker-restart=0 --durations=60 tests

# The tests that need no export (conftest.py marks the others `export`): a developer's inner loop.
test-fast: venv
	$(PY) -m pytest -q -m "not export" tests

# A peer's environment of its own, on the same CPU torch as ours: $(1) its folder, $(2) its pinned
# packages (any other torch request may pull a multi-GB CUDA build).
define peer_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q torch==2.13.0
	echo "torch==2.13.0" > $(1)/constraints.txt
	$(1)/bin/python -m pip install -q -c $(1)/constraints.txt $(2)
endef

# Optimum-ONNX pins transformers < 4.58, which current diffusers cannot use: it gets its own
# environment, with the newest versions that resolve together.
OPTIMUM_VENV := .venv-optimum
optimum-venv: $(OPTIMUM_VENV)/.installed
$(OPTIMUM_VENV)/.installed: Makefile
	$(call peer_venv,$(OPTIMUM_VENV),"optimum-onnx[onnxruntime]==0.1.0" "optimum==2.1.0" \
	  "transformers==4.57.6" "diffusers==0.39.0" "huggingface_hub==0.36.2")
	touch $@

# optimum-intel (the OpenVINO peer) pins transformers < 5.6: another environment of its own.
# openvino.genai's Text2ImagePipeline (the Flux table's other OpenVINO peer) runs optimum-intel's
# export, so it lives here too, at the same OpenVINO release.
# It declares torchvision, whose registry wheel pulls a CUDA torch and does not import with the
# CPU one; optimum-intel does not need it for diffusion, so it is installed without its deps,
# after the deps it does need.
OPTIMUM_INTEL_VENV := .venv-optimum-intel
optimum-intel-venv: $(OPTIMUM_INTEL_VENV)/.installed
$(OPTIMUM_INTEL_VENV)/.installed: Makefile
	$(call peer_venv,$(OPTIMUM_INTEL_VENV),"optimum==2.3.0" "transformers==5.5.4" "diffusers==0.39.0" \
	  "nncf==3.4.0" "openvino==2026.4.1" "openvino-tokenizers==2026.4.1.0" "huggingface_hub==1.21.0" \
	  "accelerate==1.15.0" "sentencepiece==0.2.3" "openvino-genai==2026.4.1.0")
	$(OPTIMUM_INTEL_VENV)/bin/python -m pip install -q --no-deps "optimum-intel==2.2.0"
	$(OPTIMUM_INTEL_VENV)/bin/python -c "from optimum.intel import OVStableDiffusion3Pipeline, OVFluxPipeline; \
	  from openvino_genai import Text2ImagePipeline"
	touch $@

# Builds sd3-bench (SD3-medium widths, 2 layers) once, times diffusers, Optimum-ONNX and our
# artifacts on the same weights and latents, and writes BENCHMARKS.md.
# Then the U-Net's activation memory: sd15-bench (SD1.5's real architecture) at its own size and
# batch, and what the default calibration costs that real-size model; the Flux, Z-Image and FLUX.2 tables
# against optimum-intel and openvino.genai, FLUX.2's reference table on klein KV, the Qwen-Image tables and
# the video tables, Wan's and LTX-Video's (the latter against optimum-intel and openvino.genai too; all
# skipped when BENCH_ARGS picks --tables: that names the sd3-bench tables to re-measure).
bench: venv optimum-venv optimum-intel-venv
	$(PY) -m bench --model sd3-bench --optimum-python $(OPTIMUM_VENV)/bin/python \
	  --optimum-intel-python $(OPTIMUM_INTEL_VENV)/bin/python $(BENCH_ARGS)
	$(if $(findstring --tables,$(BENCH_ARGS)),,$(PY) -m bench --model sd15-bench \
	  --tables memory,caches,controlnet-residuals,controlnet,calibration --calibration-grid default \
	  --memory-size 512 --memory-batch 2 --memory-submodules unet $(BENCH_ARGS))
	$(if $(findstring --tables,$(BENCH_ARGS)),,$(PY) -m bench --model flux-bench --tables flux,caches,first-block-split,controlnet-residuals,calibration \
	  --optimum-intel-python $(OPTIMUM_INTEL_VENV)/bin/python $(BENCH_ARGS))
	$(if $(findstring --tables,$(BENCH_ARGS)),,$(PY) -m bench --model z-image-bench --tables z-image \
	  --optimum-intel-python $(OPTIMUM_INTEL_VENV)/bin/python $(BENCH_ARGS))
	$(if $(findstring --tables,$(BENCH_ARGS)),,$(PY) -m bench --model flux2-klein-bench --tables flux2 \
	  --optimum-intel-python $(OPTIMUM_INTEL_VENV)/bin/python $(BENCH_ARGS))
	$(if $(findstring --tables,$(BENCH_ARGS)),,$(PY) -m bench --model flux2-klein-kv-bench --tables flux2-references \
	  $(BENCH_ARGS))
	$(if $(findstring --tables,$(BENCH_ARGS)),,$(PY) -m bench --model qwen-image-bench --tables qwen-image \
	  --optimum-intel-python $(OPTIMUM_INTEL_VENV)/bin/python $(BENCH_ARGS))
	$(if $(findstring --tables,$(BENCH_ARGS)),,$(PY) -m bench --model qwen-image-edit-bench --tables qwen-image-edit \
	  $(BENCH_ARGS))
	$(if $(findstring --tables,$(BENCH_ARGS)),,$(PY) -m bench --model wan-bench --tables wan,wan-vae $(BENCH_ARGS))
	$(if $(findstring --tables,$(BENCH_ARGS)),,$(PY) -m bench --model ltx-bench --tables ltx \
	  --optimum-intel-python $(OPTIMUM_INTEL_VENV)/bin/python $(BENCH_ARGS))

# The cache table where the model's depth is real (not part of `make bench`: about 20 minutes, ~25 GB of
# build): sd3-fullsize's float16 export builds no ort-fp32, and openvino-int8's calibration runs the fp32
# pipeline (about 30 GB): its runs fit in openvino-bf16 with int8 weights (bf16 weights take 14 GiB for T5 alone).
fullsize-caches: venv
	$(PY) -m bench --model sd3-fullsize --tables caches --caches-artifacts openvino-bf16-int8-weights \
	  --caches-tiny-vae "" --caches "none;taylorseer:interval=3,before=6,after=-2;first-block:100" $(BENCH_ARGS)

# Real sizes on this machine (not part of `make test`: ~15 GB of random fp16 weights, and as much
# again per stage's output): sd3-fullsize through export and the ORT and OpenVINO fp16 builds, each
# stage's peak RSS measured from outside, and each command's disk, written to BENCHMARKS.md; fails over
# SCALE_BUDGET_GIB. SCALE_MODEL=flux-fullsize checks FLUX.1-dev's 12 B transformer.
# SCALE_MODEL=z-image-fullsize checks Z-Image-Turbo's 6.2 B transformer and the whole Qwen3-4B.
# SCALE_MODEL=qwen-image-fullsize checks Qwen-Image's 20 B transformer and Qwen2.5-VL-7B's language model.
SCALE_MODEL ?= sd3-fullsize
SCALE_BUDGET_GIB ?= 16
# The serving table alone (`make bench` measures it too): sd3-bench through Triton on 127.0.0.1.
serve-bench: venv
	$(PY) -m bench --model sd3-bench --tables serving $(BENCH_ARGS)

scale-check: venv
	$(PY) -m bench.scale_check --model $(SCALE_MODEL) --budget-gib $(SCALE_BUDGET_GIB)

clean:
	rm -rf build
