# The course's commands. Each target installs what it needs into the active Python environment.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
RUN_DIR ?= runs/$(shell date +%Y%m%d-%H%M%S)

.PHONY: course test lab

## make course: run the course headless (small mode on CPU, full mode on a GPU) with a report
course:
	$(PIP) install -e ".[course,hf]"
	mkdir -p $(RUN_DIR)
	$(PYTHON) -m moe_tutorial info | tee $(RUN_DIR)/info.txt
	$(PYTHON) -m moe_tutorial train --json $(RUN_DIR)/train.json | tee $(RUN_DIR)/train.txt
	@echo "course run written to $(RUN_DIR)/"

## make test: the test suite (CPU; GPU tests skip with a reason, run them with `pytest -m gpu`)
test:
	$(PIP) install -e ".[test]"
	$(PYTHON) -m pytest

## make lab: JupyterLab on the notebooks
lab:
	$(PIP) install -e ".[course,hf]"
	mkdir -p notebooks
	$(PYTHON) -m jupyter lab notebooks/
