# The two commands of the README. Each sets up .venv on first use (and again when pyproject.toml changes).
#   make lab    open the course in JupyterLab (CPU; no GPU needed)
#   make test   run every test: pytest for course_lib, nbval for every notebook
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Jupyter refuses to run as root unless told; containers and CI often are root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab test setup benchmarks gpu-check
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

# Served from the repository's root, so that course_lib/ and labs/ are in JupyterLab's file browser; it opens
# on notebook 00. JUPYTER_PATH puts the course's kernel spec (.jupyter/kernels/python3) before the default one:
# the same Python kernel, started with the %ranks magics loaded, so they are there again after a restart.
LAB_JUPYTER_PATH := $(CURDIR)/.jupyter$(if $(JUPYTER_PATH),:$(JUPYTER_PATH))
lab: setup
	JUPYTER_PATH=$(LAB_JUPYTER_PATH) $(VENV)/bin/jupyter lab $(ROOT_FLAG) --ServerApp.root_dir=$(CURDIR) \
		--LabApp.default_url=/lab/tree/notebooks/00_training_step.ipynb

# Two workers, one test file (or notebook) each at a time: most of the suite waits (on ranks' sleeps, timeouts
# that must expire, a browser), so two files at once halve the time on 2 cores.
test: setup
	$(PY) -m pytest -n 2 --dist loadfile tests notebooks --nbval-lax --nbval-cell-timeout=300 -p no:cacheprovider

benchmarks: setup
	for script in benchmarks/*.py; do $(PY) $$script || exit 1; done

# On a GPU box: the machine, NCCL bandwidth and every lab, each checked (labs/results/summary.md). Without a GPU
# it runs the same checks as a CPU smoke run (gloo, 2 ranks), in about 40 s on 2 cores.
gpu-check: setup
	$(PY) labs/check_gpu.py
