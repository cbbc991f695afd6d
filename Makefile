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
# the `make course` run `make site` renders (run first when it holds no report.html)
SITE_RUN ?= runs/site
BOOTSTRAP = $(PYTHON) -m tools.bootstrap

.DEFAULT_GOAL := help
.PHONY: help lab course test site gpu lock

## make help: this list
help:
	@awk '/^## make /{sub(/^## /, ""); print; next} /^#   /{sub(/^#/, " "); print}' $(MAKEFILE_LIST)

## make lab: JupyterLab on your working copy work/ (chapters and exercises side by side; made on
#   first use, your files there never overwritten: delete one to get a fresh copy), opened on
#   notebooks/01_naive_moe.ipynb; LAB_FLAGS='--ip=0.0.0.0 --no-browser' passes options to Lab
# Lab opens on the first chapter, without JupyterLab's "receive news?" toast
LAB_DEFAULTS = --LabApp.default_url=/lab/tree/notebooks/01_naive_moe.ipynb --LabApp.news_url=None
lab:
	$(BOOTSTRAP) --extras course,hf -- -m moe_tutorial lab -- $(LAB_DEFAULTS) $(LAB_FLAGS)

## make course: run the course headless (small mode on CPU, full mode on a GPU) with a report
#   (mode: $MOE_TUTORIAL_MODE=small|full, else by hardware; stops at the first failing notebook)
#   into a new RUN_DIR each time; RUN_FLAGS=--replace reuses a RUN_DIR an earlier run wrote
course:
	MOE_TUTORIAL_STARTED_BY=make $(BOOTSTRAP) --extras course,hf -- -m moe_tutorial run \
	  --out $(RUN_DIR) $(RUN_FLAGS)

## make test: the test suite (CPU; GPU tests skip with a reason, run them with `pytest -m gpu`);
#   PYTEST_FLAGS='-n 0 -x' runs it in one process; what only the tests import (torchao) goes
#   beside the environment, never into it, so the chapters run the same after it
test:
	$(BOOTSTRAP) --extras test --test-only -- -m pytest $(PYTEST_FLAGS)

## make site: the executed course as a static website in build/site/ (open build/site/index.html):
#   every chapter with its outputs from the run in SITE_RUN (made first when it has no report;
#   on a CPU its GPU cells show the committed GPU run), the glossary, notes and docs, linked
site:
	@[ -f $(SITE_RUN)/report.html ] || $(MAKE) --no-print-directory course RUN_DIR=$(SITE_RUN)
	$(BOOTSTRAP) --extras course,hf -- -m tools.site --run $(SITE_RUN) --out build/site

## make gpu: on an NVIDIA GPU machine, Transformer Engine 2.20 built against the environment's
#   torch (the course's CUDA torch first, if it has none); see docs/gpu.md
gpu:
	$(BOOTSTRAP) --gpu --extras course,hf

## make lock: regenerate cpu-lock.txt, the CPU environment CI installs, for every Python the
#   course supports (resolved for the oldest, 3.11.0, checked for the newer), and the table of
#   what each pin needs of Python (cpu-lock-python.txt); needs the package index (tools/lock.py:
#   uv, which reads its own settings, e.g. UV_DEFAULT_INDEX, not pip's); LOCK_FLAGS='--find-links
#   DIR' adds a folder of wheels
lock:
	$(PYTHON) -m tools.lock $(LOCK_FLAGS)
