# Two entry points a newcomer needs: `make demo` and `make test`. Everything else is a step of those.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Portable x86-64-v3 build of llama.cpp: a wheel from pip's cache must not crash on another CPU.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
PG_URL ?= postgresql+psycopg://postgres@127.0.0.1:5432/postgres
REDIS_URL ?= redis://127.0.0.1:6379/0
DEMO_HOME ?= .bonsai/demo

.PHONY: setup demo test services lint bench clean

setup: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first: this pin takes the CPU build; the project's own range would pull a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install -q -e '.[api,signing,test]'
	# Headless Chromium and its driver for the web page test (Debian packages).
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; }
	touch $@

demo: setup
	$(BIN)/bonsai --home $(DEMO_HOME) demo-checkpoint $(DEMO_HOME)/tiny-llama
	$(BIN)/bonsai --home $(DEMO_HOME) convert $(DEMO_HOME)/tiny-llama

services:
	@pg_isready -q -h 127.0.0.1 -p 5432 || pg_ctlcluster --skip-systemctl-redirect $$(ls /etc/postgresql) main start
	@redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || redis-server --daemonize yes --bind 127.0.0.1 -::1 \
		--port 6379 --save "" --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log
	@for i in $$(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && redis-cli -h 127.0.0.1 ping >/dev/null 2>&1 \
		&& exit 0; sleep 1; done; echo "PostgreSQL or Redis did not come up" >&2; exit 1

test: setup services
	BONSAI_TEST_PG_URL=$(PG_URL) BONSAI_TEST_REDIS_URL=$(REDIS_URL) $(BIN)/python -m pytest -q

lint: setup
	$(BIN)/python -m ruff check pipeline workers tests bench

bench: setup
	$(BIN)/python bench/decompose.py

clean:
	rm -rf .bonsai .pytest_cache
