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
STAMP := $(VENV)/.installed

.PHONY: install test run serve-tiny loadtest soak lint docker-build compose-test clean help

help:
	@echo "make install     create $(VENV) and install the project with its dev extras"
	@echo "make run         serve the default preset on 127.0.0.1:8080 (ARGS=... for more flags)"
	@echo "make serve-tiny  serve the tiny preset on the CPU (fast start, for trying the API)"
	@echo "make test        run the test suite"
	@echo "make loadtest    load-test a running server at URL=$(URL) (loopback only; ARGS=\"--out r.json\" for a report + plot)"
	@echo "make soak        CI's CPU soak: a tiny server, 2,000 distinct images, replays, store readers (OUT=soak-out)"
	@echo "make lint        byte-compile everything (a cheap syntax check)"
	@echo "make docker-build  build docker/Dockerfile (needs a Docker engine)"
	@echo "make compose-test  build the CPU image, run docker/docker-compose.cpu.yml, check a chat answer"

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# The stamp makes re-runs instant; it is refreshed whenever pyproject.toml changes.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[dev]"
	touch $@

test: install
	$(PY) -m pytest -q $(ARGS)

run: install
	$(PY) -m service serve $(ARGS)

serve-tiny: install
	$(PY) -m service serve --model tiny --device cpu $(ARGS)

loadtest: install
	$(PY) bench/loadtest.py --url $(URL) $(ARGS)

# The soak CI runs (tests/test_soak.py), with its report in $(OUT).
OUT ?= soak-out
soak: install
	$(PY) bench/soak.py --serve "--model tiny --device cpu --store-capacity-bytes 2000000 --store-min-residency-s 1 \
		--min-pixels 16384 --max-pixels 16384" --images 2000 --sizes 128x128 --read-pause-ms 2 --out-dir $(OUT) $(ARGS)

lint: install
	$(PY) -m compileall -q service kernels bench tests

docker-build:
	docker build -f docker/Dockerfile -t qwen3vl-encoder:local .

# The CPU stack in a real Docker engine (tests/test_compose.py says what it needs, and why it skips).
compose-test: install
	QVE_COMPOSE_TEST=1 $(PY) -m pytest -q -rs -s tests/test_compose.py $(ARGS)

clean:
	rm -rf .pytest_cache build dist *.egg-info
	find . -name __pycache__ -type d -not -path "./$(VENV)/*" -prune -exec rm -rf {} +
