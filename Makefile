# The two commands:   make lab    (set up, then open the course in JupyterLab)
#                     make test   (set up, then run every test: library, notebooks, grader)
# Both create .venv on first use (Python 3.11) and reinstall when pyproject.toml changes.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PORT   ?= 8888
# More options for `jupyter lab` (e.g. LAB_ARGS=--no-browser); root gets --allow-root (Docker, WSL, cloud VMs).
LAB_ARGS ?=
ALLOW_ROOT := $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root)
MY_WORK ?= my_work
# JupyterLab's workspace (its open tabs and their kernels) inside this copy of the course, which git ignores: a second
# copy never reopens this one's tabs. A browser is opened only where Python finds one (else JupyterLab warns).
LAB_WORKSPACES ?= $(CURDIR)/.jupyter/lab/workspaces
OPEN_BROWSER = $(shell $(PY) -c 'import webbrowser; webbrowser.get()' >/dev/null 2>&1 && echo True || echo False)

# torch: PyPI's Linux wheel is the CUDA build (several GB of NVIDIA libraries). On Linux without an NVIDIA driver,
# setup installs the CPU wheel from PyTorch's CPU index into $(VENV) first -- unless plain pip already finds a CPU
# build (a local wheel, a mirror) or torch is installed. TORCH_CPU=yes|no overrides that guess; `make torch-plan`
# prints the decision; DRY_RUN=1 prints setup's install commands instead of running them. OS_NAME, HAS_NVIDIA
# and PIP_TORCH (the version plain pip would install) are what the guess is made from.
TORCH_PIN       := $(shell sed -n 's/^ *"\(torch==[^"]*\)",*$$/\1/p' pyproject.toml)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_CPU       ?= auto
OS_NAME         ?= $(shell uname -s)
HAS_NVIDIA      ?= $(shell if command -v nvidia-smi >/dev/null 2>&1 || [ -e /proc/driver/nvidia/version ]; \
                           then echo yes; else echo no; fi)
# The decision, as shell (no $(MAKE) in a recipe: `make -n` would run that line for real).
PIP_TORCH_VERSION = py=$(PY); [ -x "$$py" ] || py=$(PYTHON); \
	$$py -m pip install --dry-run --no-deps --quiet --report - "$(TORCH_PIN)" 2>/dev/null | $$py -c \
	'import json, sys; i = json.load(sys.stdin)["install"]; print(i[0]["metadata"]["version"] if i else "installed")'
TORCH_PLAN = if [ "$(TORCH_CPU)" = yes ]; then echo cpu-index; \
	elif [ "$(TORCH_CPU)" = no ] || [ "$(OS_NAME)" != Linux ] || [ "$(HAS_NVIDIA)" = yes ]; then echo pip-default; \
	else case "$(if $(PIP_TORCH),$(PIP_TORCH),$$($(PIP_TORCH_VERSION)))" in \
		*+cpu|installed) echo pip-default;; \
		*) echo cpu-index;; \
	esac; fi
RUN := $(if $(DRY_RUN),@echo "[dry run]",)
# A pytest run that must reach its end: tests/conftest.py writes $(VENV)/.pytest-done-NAME when the session finishes
# (under pytest-xdist, its controller does), so a test that ends the process early (exit status 0, no summary) fails
# the target instead of passing it. $(call PYTEST_TO_THE_END,command,NAME): NAME keeps lanes run side by side apart.
PYTEST_TO_THE_END = rm -f $(VENV)/.pytest-done-$(2) && COURSE_PYTEST_DONE=$(VENV)/.pytest-done-$(2) $(1) && \
	{ test -f $(VENV)/.pytest-done-$(2) || { echo "pytest ended before its summary: a test ended the process"; exit 1; }; }
# The parallel lane: pytest-xdist, a worker per core (2 on the course's machine), a test module per unit of work (its
# cached launches stay on one worker; tests/conftest.py says which modules are spread test by test).
XDIST ?= -n 2 --dist loadscope
# Each lane ends with its slowest tests (where the next minute of CI time is to be found).
DURATIONS ?= --durations=25
# The test tools (pytest, nbval, ruff, playwright: ~60 MB) where the tests are: the teacher's copy, with solutions/.
# A learner's handout (make handout) installs the course without them; `pip install -e ".[test]"` adds them.
EXTRAS ?= $(if $(wildcard solutions),[test])

.PHONY: setup lab test test-fast test-lib test-browser browser-deps test-notebooks lint execute-notebooks exercises \
	grade benchmarks clean my-copy torch-plan site test-site handout

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "the course needs Python 3.11, found " + sys.version.split()[0]'
	@echo "==> 1/4 a virtual environment in $(VENV)"
	$(RUN)$(PYTHON) -m venv $(VENV)
	$(RUN)$(PY) -m pip install --quiet --upgrade pip
	@if [ "$$($(TORCH_PLAN))" = cpu-index ]; then \
		echo "==> 2/4 $(TORCH_PIN), the CPU wheel from PyTorch's CPU index (Linux without an NVIDIA driver)"; \
		$(if $(DRY_RUN),echo "[dry run]") $(PY) -m pip install --index-url $(TORCH_CPU_INDEX) "$(TORCH_PIN)"; \
	else \
		echo "==> 2/4 $(TORCH_PIN) as pip finds it (installed with the rest)"; \
	fi
	@echo "==> 3/4 the course library, JupyterLab$(if $(EXTRAS), and the test tools) (a few minutes the first time)"
	$(RUN)PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -e ".$(EXTRAS)"
	@echo "==> 4/4 the notebook kernel"
	$(RUN)$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (LLM scaling course)"
	$(RUN)$(PY) -m course_lib.course.kernel_log
	@$(if $(DRY_RUN),echo "[dry run]") touch $(STAMP)

## What setup does about torch here: cpu-index (PyTorch's CPU wheel) or pip-default (plain pip's choice).
torch-plan:
	@$(TORCH_PLAN)

## Open the course: JupyterLab on 127.0.0.1 with token authentication at the start page (open the URL it prints).
## It serves your own copy, $(MY_WORK)/ (made or brought up to date first: see my-copy), never the tracked
## notebooks: JupyterLab's autosave then cannot change a file `git pull` updates. It runs in $(MY_WORK)/, so its
## terminal starts there (`make grade NB=exercises/...` works there). The project's JupyterLab settings
## (jupyter/lab/settings/overrides.json: no news or update toasts) are defaults; yours still win. No
## language-server detection (the course uses none: it only printed the servers it did not find).
lab: my-copy
	@echo "==> JupyterLab on 127.0.0.1 only, token-protected, serving $(MY_WORK)/; open the URL printed below: it opens notebooks/START_HERE.ipynb there"
	cd "$(MY_WORK)" && "$(abspath $(VENV))/bin/jupyter" lab --ServerApp.ip=127.0.0.1 --ServerApp.port=$(PORT) \
		--ServerApp.open_browser=$(OPEN_BROWSER) \
		--ServerApp.root_dir="$(abspath $(MY_WORK))" --LabApp.default_url=/lab/tree/notebooks/START_HERE.ipynb \
		--LabApp.app_settings_dir="$(CURDIR)/jupyter/lab/settings" --LabApp.workspaces_dir="$(LAB_WORKSPACES)" \
		--LanguageServerManager.autodetect=False $(ALLOW_ROOT) $(LAB_ARGS)

## Your own copy of the course in $(MY_WORK)/ (git ignores it): notebooks/ (the chapters) and exercises/ (your
## answers). Run again (make lab does) after a `git pull`: new notebooks are copied, a notebook you only ran gets
## the new version, one you edited is kept as it is (course_lib/course/my_copy.py).
my-copy: $(STAMP)
	$(PY) -m course_lib.course.my_copy --dest "$(MY_WORK)"

## Every test: lint, the library (pytest), the parity tests on generic kernels, the widgets in a real browser, every
## notebook (nbval). This is what CI runs; `make test-fast` is the quick loop. Two lanes side by side: the parallel
## one (two pytest-xdist workers: the library and the grader), and the other lane's targets one after the other:
## the tests marked `serial` first (timing-sensitive: hang reports, stragglers, grading time limits, launcher kills
## and faults, under the load the parallel lane makes), then the generic-kernel lane, the browser and the notebooks
## (nbval; a few notebooks run in the parallel lane's tail instead: NB_PARALLEL). Each lane's output is printed whole
## when it ends; every target of the second lane runs even if one before failed.
# One OpenMP thread in every test process and what it starts (ranks, kernels, graders): the lanes run 3-4 pytest
# processes and their ranks on 2 cores, where OpenMP's spinning threads burn the cores the others wait for (the
# grader's wrong answers: 260 -> 232 core-s). Ranks and many tests set one thread already. Not for `make lab`.
TEST_THREADS ?= 1
TEST_TARGETS := test test-fast test-lib test-lib-parallel test-lib-serial test-lane-beside test-parity-generic \
	test-browser test-notebooks
$(TEST_TARGETS): export OMP_NUM_THREADS := $(TEST_THREADS)
# Compiled modules and pytest's rewritten test modules are cached in __pycache__ (git ignores it) even where the
# environment sets PYTHONDONTWRITEBYTECODE: else every pytest process, kernel and grader compiles them again (test
# collection: 20 -> 12 s per pytest process).
$(TEST_TARGETS): export PYTHONDONTWRITEBYTECODE :=

# make test balances its lanes with the notebooks: nbval runs these in the parallel lane's tail (its pytest-xdist
# workers take them as they come free), the others at the end of the lane beside it (CI on 2 cores: the lanes took
# 990 s and 1116 s with every notebook beside).
NB_PARALLEL := notebooks/08_composing_4d.ipynb notebooks/09_serving.ipynb notebooks/11_debugging.ipynb
# Set-up and Debian's chromium (apt-get, as root on a fresh machine: ~35 s of download and unpacking) side by side,
# before the lanes: neither then holds up a lane. Chromium's install failing stops nothing here (test-browser tries
# again and fails with its error); set-up failing stops `make test`.
test:
	@$(MAKE) --no-print-directory -k -j2 --output-sync=target $(STAMP) browser-deps || \
		$(MAKE) --no-print-directory $(STAMP)
	@$(MAKE) --no-print-directory lint
	@$(MAKE) --no-print-directory -j2 --output-sync=target test-lib-parallel test-lane-beside NB_SPLIT=yes

.PHONY: test-lane-beside
test-lane-beside: $(STAMP)
	@failed=""; for t in test-lib-serial test-parity-generic test-browser test-notebooks; do \
		$(MAKE) --no-print-directory $$t || failed="$$failed $$t"; done; \
	test -z "$$failed" || { echo "failed:$$failed"; exit 1; }

## The library alone, in the two lanes of `make test` (the parallel one, and the serial tests beside it).
test-lib: $(STAMP)
	@$(MAKE) --no-print-directory -j2 --output-sync=target test-lib-parallel test-lib-serial

.PHONY: test-lib-parallel test-lib-serial
test-lib-parallel: $(STAMP)
	$(call PYTEST_TO_THE_END,$(PY) -m pytest tests $(if $(NB_SPLIT),$(NBVAL) $(NB_PARALLEL)) $(XDIST) $(DURATIONS) \
		-m "not browser and not serial",parallel)

test-lib-serial: $(STAMP)
	$(call PYTEST_TO_THE_END,$(PY) -m pytest tests -p no:xdist $(DURATIONS) -m "serial and not browser",serial)

## The widgets in JupyterLab, driven by Debian's chromium through Playwright (screenshots in artifacts/browser/).
## Without chromium they are skipped with how to enable them; under CI=... they fail instead.
test-browser: $(STAMP) browser-deps
	$(PY) -m pytest tests/browser -m browser

## The tests marked `generic_kernels` (a representative set of the parity tests and of the tests with a tolerance
## measured on one machine: its rule is next to the marker, in pyproject.toml) again on PyTorch's generic CPU kernels
## instead of this CPU's AVX2/AVX-512 ones: other roundings, so a tolerance tuned to one kernel path fails on every
## machine (course_lib/train.py).
.PHONY: test-parity-generic
test-parity-generic: $(STAMP)
	$(call PYTEST_TO_THE_END,ATEN_CPU_CAPABILITY=default $(PY) -m pytest tests $(XDIST) $(DURATIONS) -m "generic_kernels and not browser",generic)

## Debian's chromium for the browser tests (never `playwright install`): apt-get when root, else how to get it.
browser-deps:
	@if command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ] || [ -n "$$COURSE_CHROMIUM" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's chromium for the browser tests"; \
		apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; \
	else \
		echo "chromium is missing: the browser tests will be skipped (under CI they fail). To enable them:"; \
		echo "  Debian/Ubuntu: sudo apt-get update && sudo apt-get install -y chromium  (or: sudo make browser-deps)"; \
		echo "  elsewhere: COURSE_CHROMIUM=/path/to/chromium-or-chrome make test-browser"; \
	fi

## Every chapter under nbval, two notebooks at a time (each notebook whole on one worker: its cells share a kernel).
## The kernels talk over Unix sockets, not TCP ports that gloo's connections could take first (tests/nbval_ipc.py).
NBVAL := --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg -p no:cacheprovider \
	-p tests.nbval_ipc
test-notebooks: $(STAMP)
	$(PY) -m pytest $(NBVAL) -n 2 --dist loadfile \
		$(if $(NB_SPLIT),$(filter-out $(NB_PARALLEL),$(sort $(wildcard notebooks/*.ipynb))),notebooks)

## The quick loop for every change (about 2.5 minutes on 2 cores, README): each module's unit tests and one parity
## test per axis (marker `fast`); no slow multi-launch or 4-rank tests, no timing-sensitive lane, no browser, no
## notebooks.
test-fast: $(STAMP)
	$(call PYTEST_TO_THE_END,$(PY) -m pytest tests $(XDIST) -q -m "fast or not (slow or parity or serial or browser)",fast)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

## Re-execute the notebooks in place (their outputs are committed and compared by nbval).
execute-notebooks: $(STAMP)
	for nb in notebooks/*.ipynb; do \
		$(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=600 $$nb || exit 1; \
	done

## Regenerate exercises/ from solutions/ (the solutions are the single source of truth). An exercise notebook
## whose code someone edited is kept (FORCE=1 overwrites it; `make my-copy` is where learners work).
exercises: $(STAMP)
	$(PY) -m course_lib.grading.notebooks $(if $(FORCE),--force)

## Grade: make grade NB=notebook.ipynb (the course's exercises/NN_..._exercises.ipynb grades your copy in
## $(MY_WORK)/ when you have one), or NB=folder/ for a class (one notebook per learner, any names: writes
## $(CSV), its summary and totals), JOBS notebooks at a time, each within TIME_LIMIT seconds, isolated where the
## machine allows it (ISOLATION=no for trusted work), after a canary (the course's own solution must score full
## marks). Prints the score and exits 0; GRADE_ARGS=--strict exits 1 unless every mark is earned.
JOBS ?= 1
TIME_LIMIT ?= 600
ISOLATION ?= yes
CSV ?= gradebook.csv
grade: $(STAMP)
	@test -n "$(NB)" || { echo "usage: make grade NB=path/to/notebook_or_folder [JOBS=2 TIME_LIMIT=600 ISOLATION=no GRADE_ARGS=--strict]"; exit 2; }
	@if [ -d "$(NB)" ]; then $(PY) -m course_lib.grading.gradebook "$(NB)" --out "$(CSV)" --jobs $(JOBS) \
		--time-limit $(TIME_LIMIT) $(if $(filter no,$(ISOLATION)),--no-isolation) $(GRADE_ARGS); \
	else $(PY) -m course_lib.grading "$(NB)" --my-work "$(MY_WORK)" --timeout $(TIME_LIMIT) $(GRADE_ARGS); fi

## The learners' copy without solutions/ (its own README, Makefile and install, no test tools): make handout OUT=dir
OUT ?= handout
handout: $(STAMP)
	$(PY) -m course_lib.course.handout $(OUT)

## The course as a static site (site/index.html): chapters, figures, math, exercises without solutions.
site: $(STAMP)
	$(PY) -m course_lib.course.site site

## The site built and checked: links, images, no solutions (pytest), then every page in chromium.
test-site: $(STAMP) browser-deps
	$(PY) -m pytest tests/test_site.py tests/browser/test_site_browser.py

benchmarks: $(STAMP)
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site handout gradebook*.csv
