# Two entry points a newcomer needs: `make demo` and `make test`. Everything else is a step of those.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Portable x86-64-v3 build of llama.cpp: a wheel from pip's cache must not crash on another CPU.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
PG_URL ?= postgresql+psycopg://postgres@127.0.0.1:5432/postgres
REDIS_URL ?= redis://127.0.0.1:6379/0
# The demo's checkpoint; its job goes to the default home (.bonsai), where `bonsai jobs` looks.
DEMO_DIR ?= .bonsai/demo
# The test S3 server (SeaweedFS from the test extra), loopback only, data in a scratch folder.
S3_PORT ?= 8333
S3_DIR ?= /tmp/bonsai-seaweedfs
WEED_ARGS = server -dir=$(S3_DIR) -ip=127.0.0.1 -ip.bind=127.0.0.1 -master.port=19333 -master.port.grpc=19334 \
	-volume.port=18080 -volume.port.grpc=18081 -filer.port=18888 -filer.port.grpc=18889 -s3 -s3.port=$(S3_PORT) \
	-s3.port.grpc=18334 -s3.port.iceberg=0 -s3.port.lance=0 -s3.config=$(CURDIR)/tests/support/seaweedfs_s3.json \
	-volume.max=0 -master.volumeSizeLimitMB=256 -master.electionTimeout=1s

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

# Ends with ./tiny-llama-TQ2_0.gguf (--force: a rerun replaces the demo's own file) and `bonsai show N`.
demo: setup
	$(BIN)/bonsai demo-checkpoint $(DEMO_DIR)/tiny-llama
	$(BIN)/bonsai convert $(DEMO_DIR)/tiny-llama --force

services: setup
	@pg_isready -q -h 127.0.0.1 -p 5432 || pg_ctlcluster --skip-systemctl-redirect $$(ls /etc/postgresql) main start
	@redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || redis-server --daemonize yes --bind 127.0.0.1 -::1 \
		--port 6379 --save "" --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log
	@# setsid -f: the server leaves this shell at once, holding none of make's output open.
	@(exec 3<>/dev/tcp/127.0.0.1/$(S3_PORT)) 2>/dev/null || { mkdir -p $(S3_DIR) && \
		setsid -f $(BIN)/weed $(WEED_ARGS) >$(S3_DIR)/weed.log 2>&1 < /dev/null; }
	@for i in $$(seq 1 60); do pg_isready -q -h 127.0.0.1 -p 5432 && redis-cli -h 127.0.0.1 ping >/dev/null 2>&1 \
		&& $(BIN)/python -c "from tests.support.seaweed import wait_until_serving as w; \
		w('http://127.0.0.1:$(S3_PORT)', 1)" 2>/dev/null && exit 0; sleep 1; done; \
		echo "PostgreSQL, Redis or SeaweedFS (log: $(S3_DIR)/weed.log) did not come up" >&2; exit 1

test: setup services
	BONSAI_TEST_PG_URL=$(PG_URL) BONSAI_TEST_REDIS_URL=$(REDIS_URL) BONSAI_TEST_S3_URL=http://127.0.0.1:$(S3_PORT) \
		$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/python -m ruff check pipeline workers tests bench

bench: setup
	$(BIN)/python bench/decompose.py

clean:
	rm -rf .bonsai .pytest_cache tiny-llama-TQ2_0.gguf
