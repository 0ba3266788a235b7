# Two entry points a reader needs: `make book` and `make test`.
# Both create .venv on first use and install the pinned stack (constraints.txt).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# One thread per rank: four gloo ranks on a two-core laptop must not fight over cores.
export OMP_NUM_THREADS ?= 1

.PHONY: book test check-book venv exercises bench clean lab po

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[book,test,hf,torchft]'
	# DeepSpeed builds against the installed torch (no build isolation) and compiles
	# none of its ops at install time (DS_BUILD_OPS=0); Chapter 4 runs it on CPU ranks.
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet --no-build-isolation \
	    -c constraints.txt setuptools wheel deepspeed
	touch $@

# dtlib's own sentences (feedback, errors) in Chinese: the catalog compiled to a .mo.
MO = dtlib/locale/zh_CN/LC_MESSAGES/dtlib.mo
$(MO): dtlib/locale/zh_CN/LC_MESSAGES/dtlib.po $(BIN)/.installed
	$(BIN)/python -m dtlib.exercises.catalogs compile $< $@

venv: $(BIN)/.installed $(MO)

## Build the executed book into _build/html (runs every notebook once, cached).
# The execution cache keys on notebook code only: a change in dtlib must re-execute.
book: venv
	@if [ -d _build/.jupyter_cache ] && [ -n "$$(find dtlib -name '*.py' -newer _build/.jupyter_cache)" ]; then \
	    echo "dtlib changed: clearing the notebook execution cache"; rm -rf _build/.jupyter_cache; fi
	$(BIN)/jupyter-book build . --all -n -W --keep-going
	touch _build/.jupyter_cache
	# The Chinese edition beside it, from the same execution cache (no notebook runs
	# again) and the catalogs in locale/zh_CN; a broken translation fails it as -W does.
	$(BIN)/sphinx-build -q -b html -c _ext -D language=zh_CN -n -W --keep-going \
	    . _build/html/zh_CN -d _build/.doctrees-zh_CN
	printf '<meta http-equiv="Refresh" content="0; url=book/intro.html" />\n' \
	    > _build/html/zh_CN/index.html

## Bring the Chinese catalogs in step with the English sources: extract every message
## (no notebook runs) and let sphinx-intl add new ones, mark changed ones fuzzy and
## retire removed ones. Then translate what `make test` names (README, "Chinese edition").
po: venv
	rm -rf _build/gettext
	$(BIN)/python -c "from pathlib import Path; from dtlib.exercises.catalogs import \
	    extract; extract(Path('.').resolve(), Path('_build/gettext').resolve())"
	$(BIN)/sphinx-intl update -p _build/gettext -l zh_CN -d locale
	$(BIN)/pybabel extract -k _ -k N_ -k ngettext:1,2 --no-location --sort-output \
	    --project=dtlib -o dtlib/locale/dtlib.pot dtlib
	$(BIN)/pybabel update -D dtlib -i dtlib/locale/dtlib.pot -d dtlib/locale -l zh_CN

## Run every test: unit tests, multi-rank tests, and every notebook under nbval.
## On JOBS pytest workers (default 2, CI's cores; JOBS=1: one process, in order): each
## file runs whole on one worker, so a notebook keeps its kernel and a test module its
## shared launches.
JOBS ?= 2
test: venv
	$(BIN)/python -m pytest --durations=15 $(if $(filter-out 1,$(JOBS)),-n $(JOBS) --dist loadfile) \
	    --nbval-lax --nbval-current-env --nbval-cell-timeout=240 tests notebooks

## The built book as a reader sees it: every page in headless Chromium, offline
## (tables, typeset math, no CDN asset, no inf/nan, no library frames, alt text), no
## file-access flag; Chapters 1 and 11's live calculators checked against dtlib;
## screenshots of each chapter go to _build/screenshots/; a learner copy opened in
## JupyterLab (the lab extra) against a server on 127.0.0.1. Needs `make book` first.
check-book: $(BIN)/.lab-installed
	DTLIB_REQUIRE_BOOK=1 $(BIN)/python -m pytest -v tests/rendered

## Learner notebooks: every solution replaced by `raise NotImplementedError`.
## A copy you edited is never overwritten (FORCE=1 overwrites it).
## LANG=zh_CN (or a zh_CN locale in LANG): Chinese copies in exercises/zh_CN, their
## prose from the catalogs and the checkers' feedback in Chinese. Any other LANG
## (C.UTF-8, en_US.UTF-8, ...) is the English edition in exercises/.
EDITION   = $(if $(filter zh_CN%,$(LANG)),zh_CN,en)
EXERCISES = exercises$(if $(filter zh_CN,$(EDITION)),/zh_CN)
exercises: venv
	$(BIN)/python -m dtlib.exercises strip notebooks -o $(EXERCISES) \
	    --lang $(EDITION) $(if $(FORCE),--force)

## JupyterLab on the learner copies (exercises/), with jupyterlab-myst so the book's
## directives and prose numbers render. Installs the pinned `lab` extra on first use.
$(BIN)/.lab-installed: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[book,test,lab]'
	touch $@

# Trusted, so that jupyterlab-myst evaluates the copies' {eval} roles (they are ours).
# JupyterLab refuses to start as root without --allow-root (containers, CI machines).
# LANG=zh_CN: JupyterLab's own menus in Chinese too (its zh_CN language pack), from a
# settings folder of the Chinese copies, so the English lab keeps its settings.
lab: $(BIN)/.lab-installed exercises
	$(BIN)/jupyter trust $(EXERCISES)/*.ipynb
	$(if $(filter zh_CN,$(EDITION)),$(BIN)/python -m dtlib.exercises.lab settings \
	    _build/lab-settings-zh_CN zh_CN &&) \
	$(if $(filter zh_CN,$(EDITION)),JUPYTERLAB_SETTINGS_DIR=_build/lab-settings-zh_CN) \
	$(BIN)/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) $(EXERCISES)/

## Removes build outputs only: exercises/ holds the learner's work and is never removed.
clean:
	rm -rf _build

## The GPU suite (one line per check, under 8 minutes): chapters 0, 2, 3, 4, 6 and the
## capstone on NCCL with one rank per GPU, busbw, matmul share of peak, memory vs plan.
## Uses .venv when it exists, else $(PYTHON): a CUDA build of torch must be installed.
## Without CUDA it prints one line saying so and exits 0.
.PHONY: gpu-check
gpu-check:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) -m dtlib.bench gpu
