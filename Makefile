# The two commands:   make lab    (set up, then open the course in JupyterLab)
#                     make test   (set up, then run every test: library, notebooks, grader)
# Both create .venv on first use (Python 3.11) and reinstall when pyproject.toml changes.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PORT   ?= 8888
NBVAL  := --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg -p no:cacheprovider

.PHONY: setup lab test test-fast test-lib test-browser browser-deps test-notebooks lint execute-notebooks exercises grade benchmarks clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "the course needs Python 3.11, found " + sys.version.split()[0]'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (LLM scaling course)"
	@touch $(STAMP)

## Open the course: JupyterLab on 127.0.0.1 with token authentication, at the start page.
lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.port=$(PORT) --ServerApp.open_browser=True \
		notebooks/START_HERE.ipynb

## Every test: lint, the library (pytest), the widgets in a real browser, every notebook (nbval). This is what CI runs.
test: $(STAMP) lint test-lib test-browser test-notebooks

## The library; the browser tests run once, in test-browser.
test-lib: $(STAMP)
	$(PY) -m pytest tests -m "not browser"

## The widgets in JupyterLab, driven by Debian's chromium through Playwright (screenshots in artifacts/browser/).
## Without chromium they are skipped with how to enable them; under CI=... they fail instead.
test-browser: $(STAMP) browser-deps
	$(PY) -m pytest tests/browser -m browser

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

test-notebooks: $(STAMP)
	$(PY) -m pytest $(NBVAL) notebooks

## Quick loop while editing: library tests without the slow multi-launch ones, no browser, no notebooks.
test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not slow and not browser" -x -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

## Re-execute the notebooks in place (their outputs are committed and compared by nbval).
execute-notebooks: $(STAMP)
	for nb in notebooks/*.ipynb; do \
		$(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=600 $$nb || exit 1; \
	done

## Regenerate exercises/ from solutions/ (the solutions are the single source of truth).
exercises: $(STAMP)
	$(PY) -m course_lib.grading.notebooks

## Grade notebooks: make grade NB=path/to/notebook_or_folder
grade: $(STAMP)
	$(PY) -m course_lib.grading $(NB)

benchmarks: $(STAMP)
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
