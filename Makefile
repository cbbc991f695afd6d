# The course's commands. Each sets up what it needs, from the system's python3 alone
# (tools/bootstrap.py): the active virtual or conda environment, else .venv in this
# repository (created on first use, seeing the system's torch where it has one); the CPU build of
# torch on a machine without an NVIDIA GPU; then the course with the extras the command needs.
# Once installed, a command starts straight away, without the network, until pyproject.toml or
# cpu-lock.txt changes.
PYTHON ?= python3
RUN_DIR ?= runs/$(shell date +%Y%m%d-%H%M%S)
RUN_FLAGS ?=
# more arguments for `jupyter lab`, e.g. LAB_FLAGS='--ip=0.0.0.0 --no-browser' in a container
LAB_FLAGS ?=
# pytest's options for `make test`: parallel workers, one per core; tests sharing a
# module-scoped fixture stay on one worker (tests/conftest.py)
PYTEST_FLAGS ?= -n auto --dist loadscope --no-loadscope-reorder
BOOTSTRAP = $(PYTHON) -m tools.bootstrap

.DEFAULT_GOAL := help
.PHONY: help lab course test gpu lock

## make help: this list
help:
	@awk '/^## make /{sub(/^## /, ""); print; next} /^#   /{sub(/^#/, " "); print}' $(MAKEFILE_LIST)

## make lab: JupyterLab on your working copy work/ (chapters and exercises side by side; made on
#   first use, your files there never overwritten: delete one to get a fresh copy); start with
#   notebooks/01_naive_moe.ipynb; LAB_FLAGS='--ip=0.0.0.0 --no-browser' passes options to Lab
lab:
	$(BOOTSTRAP) --extras course,hf -- -m moe_tutorial lab -- $(LAB_FLAGS)

## make course: run the course headless (small mode on CPU, full mode on a GPU) with a report
#   (mode: $MOE_TUTORIAL_MODE=small|full, else by hardware; stops at the first failing notebook)
#   into a new RUN_DIR each time; RUN_FLAGS=--replace reuses a RUN_DIR an earlier run wrote
course:
	$(BOOTSTRAP) --extras course,hf -- -m moe_tutorial run --out $(RUN_DIR) $(RUN_FLAGS)

## make test: the test suite (CPU; GPU tests skip with a reason, run them with `pytest -m gpu`);
#   PYTEST_FLAGS='-n 0 -x' runs it in one process
test:
	$(BOOTSTRAP) --extras test -- -m pytest $(PYTEST_FLAGS)

## make gpu: on an NVIDIA GPU machine, Transformer Engine 2.20 built against the environment's
#   torch (the course's CUDA torch first, if it has none); see docs/gpu.md
gpu:
	$(BOOTSTRAP) --gpu --extras course,hf

## make lock: regenerate cpu-lock.txt, the CPU environment CI installs (pip-tools, in a
#   throwaway venv; needs the package index); pip-tools resolves with pip itself, so through
#   pip's configuration (its indexes, the CPU build of torch), as the install from the lock does
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install --quiet pip-tools
	$(PYTHON) -c 'from tools.bootstrap import CPU_TORCH; print(CPU_TORCH + "+cpu")' \
	  > .lock-venv/torch-cpu.txt
	CUSTOM_COMPILE_COMMAND='make lock' .lock-venv/bin/pip-compile --quiet --extra test --extra course --extra hf --strip-extras \
	  --allow-unsafe --no-emit-find-links --no-emit-index-url --no-emit-trusted-host \
	  --extra-index-url https://download.pytorch.org/whl/cpu --pip-args '--retries 0 --timeout 20' \
	  -c .lock-venv/torch-cpu.txt -o cpu-lock.txt pyproject.toml
	@# torch without its +cpu label: the CPU wheel index's build and the same version from
	@# another index (the bootstrap's fallback) both satisfy it
	sed -i 's/^torch==\(.*\)+cpu$$/torch==\1/; /-c \.lock-venv\/torch-cpu\.txt/d' cpu-lock.txt
	rm -rf .lock-venv
