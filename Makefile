# The course's commands. Each target installs what it needs into the active Python environment.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
RUN_DIR ?= runs/$(shell date +%Y%m%d-%H%M%S)

.PHONY: course test lab

## make course: run the course headless (small mode on CPU, full mode on a GPU) with a report
#   (mode: $MOE_TUTORIAL_MODE=small|full, else by hardware; stops at the first failing notebook)
course:
	$(PIP) install -e ".[course,hf]"
	$(PYTHON) -m moe_tutorial run --out $(RUN_DIR)

## make test: the test suite (CPU; GPU tests skip with a reason, run them with `pytest -m gpu`)
test:
	$(PIP) install -e ".[test]"
	$(PYTHON) -m pytest

## make lab: JupyterLab on the notebooks
lab:
	$(PIP) install -e ".[course,hf]"
	mkdir -p notebooks
	$(PYTHON) -m jupyter lab notebooks/
