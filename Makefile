# Set-up and everyday commands. On a fresh machine: `make run` (serve) and `make test`.
# Override on the command line: `make run ARGS="--model tiny --port 9000"`, `make test ARGS="-k store"`,
# `make install PYTHON=python3.12`.

PYTHON ?= python3
VENV ?= .venv
ARGS ?=
URL ?= http://127.0.0.1:8080
# NOTE: torch is installed first and pinned. This version's CPU build lies on the development machines'
# disk; an unpinned `torch` (or the project's `torch>=2.4`) with no torch installed would make pip fetch
# a multi-GB CUDA build. Once it is installed, the project's range is satisfied and pip adds nothing.
TORCH_SPEC ?= torch==2.13.0

PY := $(VENV)/bin/python
# Three stamps: serving needs only the project's own dependencies (`make run`, `make try`); the load
# test adds just the `loadtest` extra (rich, matplotlib: seconds, where the dev extras take about a
# minute); the test suite and the linters add the dev extras (`make test`, what CI runs on a fresh clone).
SERVE_STAMP := $(VENV)/.installed-serve
LOADTEST_STAMP := $(VENV)/.installed-loadtest
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: install install-serve test test-fast run serve-tiny try demo loadtest soak lint docker-build compose-test clean help

help:
	@echo "make install     create $(VENV) and install the project with its dev extras"
	@echo "make install-serve  create $(VENV) and install only what serving needs"
	@echo "make run         serve the default preset on 127.0.0.1:8080 (ARGS=... for more flags)"
	@echo "make serve-tiny  serve the tiny preset on the CPU (fast start, for trying the API)"
	@echo "make try         post a test image to the server at URL=$(URL), print the answer and the file"
	@echo "make demo        the whole pipeline here: a tiny RANDOM checkpoint, encoder + LM consumer, one chat answer"
	@echo "make test        run the test suite (what CI runs)"
	@echo "make test-fast   the suite without the tests marked slow (soak, chaos, SIGKILL, real load-test runs)"
	@echo "make loadtest    qwen3vl-encoder loadtest against the server at URL=$(URL) (loopback only; on a laptop,"
	@echo "                 against make serve-tiny; ARGS=\"--out r.json\" for a report + plot, ARGS=--help for every flag)"
	@echo "make soak        qwen3vl-encoder soak as CI runs it: a tiny server, 2,000 distinct images, replays, store"
	@echo "                 readers (report in OUT=soak-out)"
	@echo "make lint        byte-compile everything (a cheap syntax check)"
	@echo "make docker-build  build docker/Dockerfile (needs a Docker engine)"
	@echo "make compose-test  build the CPU images, run docker/docker-compose.cpu.yml and docker-compose.mooncake.yml,"
	@echo "                 check their chat answers (as root with apt it installs docker.io and debootstrap and"
	@echo "                 fetches compose v2 for the run where they are missing; QVE_COMPOSE_V2_FETCH=0: no fetch)"

install: $(DEV_STAMP)

install-serve: $(SERVE_STAMP)

$(PY):
	@echo "==> creating the virtual environment $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)

# The stamps make re-runs instant; each is refreshed whenever pyproject.toml changes.
# NOTE: --no-compile, then COMPILE once the packages are in: pip byte-compiles one file at a time (install
# 101 s instead of 56 s on a fresh clone here), compileall in one process per core (53 s for the whole
# venv, dev extras included). Compiled they must be: where PYTHONDONTWRITEBYTECODE is set (it is on the
# development and CI machines) Python never caches what it compiles, so every process compiled torch and
# transformers again: a tiny server was ready after 22 s, 9.7 s with the venv compiled, and the test suite
# starts some hundred. compileall skips what is up to date, and a file that does not compile (a package's
# template) is only left uncompiled: `python -c` ignores compile_dir's False.
COMPILE = $(PY) -c "import compileall, sysconfig; compileall.compile_dir(sysconfig.get_paths()['purelib'], quiet=2, workers=0)"
$(SERVE_STAMP): pyproject.toml | $(PY)
	@echo "==> upgrading pip in $(VENV)"
	$(PY) -m pip install -q --upgrade pip
	@echo "==> installing $(TORCH_SPEC) (CPU build where a local wheel is configured; the largest step)"
	$(PY) -m pip install --no-compile "$(TORCH_SPEC)"
	@echo "==> installing the service and what serving needs (no dev extras)"
	$(PY) -m pip install --no-compile -e .
	@echo "==> byte-compiling $(VENV)'s packages"
	$(COMPILE)
	@echo "==> installed: $(VENV) is ready to serve"
	touch $@

$(LOADTEST_STAMP): $(SERVE_STAMP) pyproject.toml
	@echo "==> installing the load test's extra (rich, matplotlib)"
	$(PY) -m pip install --no-compile -e ".[loadtest]"
	touch $@

$(DEV_STAMP): $(SERVE_STAMP) pyproject.toml
	@echo "==> installing the dev extras (test suite, load test)"
	$(PY) -m pip install --no-compile -e ".[dev]"
	$(COMPILE)
	touch $@

# In parallel, one worker per core (pytest-xdist); a worker that runs out of tests takes some of another's.
PARALLEL ?= -n auto --dist worksteal
test: $(DEV_STAMP)
	$(PY) -m pytest -q $(PARALLEL) $(ARGS)

# The inner loop: everything but the long system tests (pyproject.toml's `slow` marker says which).
test-fast: $(DEV_STAMP)
	$(PY) -m pytest -q $(PARALLEL) -m "not slow" $(ARGS)

run: $(SERVE_STAMP)
	@echo "==> serving; flags go in ARGS=\"...\" (every flag, its default and its QVE_ variable: make run ARGS=--help)"
	$(PY) -m service serve $(ARGS)

serve-tiny: $(SERVE_STAMP)
	$(PY) -m service serve --model tiny --device cpu $(ARGS)

try: $(SERVE_STAMP)
	$(PY) -m service try --url $(URL) $(ARGS)

demo: $(SERVE_STAMP)
	$(PY) -m service demo $(ARGS)

loadtest: $(LOADTEST_STAMP)
	$(PY) -m service loadtest --url $(URL) $(ARGS)

# The soak CI runs (tests/system/test_soak.py), with its report in $(OUT).
OUT ?= soak-out
soak: $(DEV_STAMP)
	$(PY) -m service soak --serve "--model tiny --device cpu --store-capacity-bytes 2000000 --store-min-residency-s 1 \
		--min-pixels 16384 --max-pixels 16384" --images 2000 --sizes 128x128 --read-pause-ms 2 --out-dir $(OUT) $(ARGS)

lint: $(DEV_STAMP)
	$(PY) -m compileall -q service bench tests

docker-build:
	docker build -f docker/Dockerfile -t qwen3vl-encoder:local .

# The CPU stacks in a real Docker engine (tests/system/test_compose.py says what it needs, and why it skips).
compose-test: $(DEV_STAMP)
	QVE_COMPOSE_TEST=1 $(PY) -m pytest -q -rs -s tests/system/test_compose.py $(ARGS)

clean:
	rm -rf .pytest_cache build dist *.egg-info
	find . -name __pycache__ -type d -not -path "./$(VENV)/*" -prune -exec rm -rf {} +
