# The course's commands. Each sets up what it needs, from the system's python3 alone
# (moe_tutorial/bootstrap.py): the active virtual or conda environment, else .venv in this
# repository (created on first use); the CPU build of torch on a machine without an NVIDIA GPU;
# then the course with the extras the command needs.
PYTHON ?= python3
RUN_DIR ?= runs/$(shell date +%Y%m%d-%H%M%S)
RUN_FLAGS ?=
BOOTSTRAP = $(PYTHON) -m moe_tutorial.bootstrap

.PHONY: course test lab

## make course: run the course headless (small mode on CPU, full mode on a GPU) with a report
#   (mode: $MOE_TUTORIAL_MODE=small|full, else by hardware; stops at the first failing notebook)
#   into a new RUN_DIR each time; RUN_FLAGS=--replace reuses a RUN_DIR an earlier run wrote
course:
	$(BOOTSTRAP) --extras course,hf -- -m moe_tutorial run --out $(RUN_DIR) $(RUN_FLAGS)

## make test: the test suite (CPU; GPU tests skip with a reason, run them with `pytest -m gpu`)
test:
	$(BOOTSTRAP) --extras test -- -m pytest

## make lab: JupyterLab on your working copy work/ (chapters and exercises; made on first use,
#   your files there never overwritten: delete one to get a fresh copy); start with 00_setup
lab:
	$(BOOTSTRAP) --extras course,hf -- -m moe_tutorial lab
