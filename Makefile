# The two commands of the README. Each sets up .venv on first use (and again when pyproject.toml changes).
#   make lab    open the course in JupyterLab (CPU; no GPU needed)
#   make test   run every test: pytest for course_lib, nbval for every notebook
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Jupyter refuses to run as root unless told; containers and CI often are root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab test setup benchmarks
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

lab: setup
	$(VENV)/bin/jupyter lab $(ROOT_FLAG) notebooks/00_training_step.ipynb

test: setup
	$(PY) -m pytest tests notebooks --nbval-lax --nbval-cell-timeout=300 -p no:cacheprovider

benchmarks: setup
	for script in benchmarks/*.py; do $(PY) $$script || exit 1; done
