# The two commands for a fresh machine: `make run` and `make test`.
.PHONY: run test test-slow lint bench setup-run setup-test

PORT ?= 8000
ARGS ?=

setup-run:
	@scripts/setup.sh run

setup-test:
	@scripts/setup.sh test

## Serve the bundled SmolLM2-135M-Instruct on 127.0.0.1:$(PORT) (OpenAI-compatible API).
run: setup-run
	.venv/bin/kvpool serve --port $(PORT) $(ARGS)

## The default test suite (what CI runs).
test: setup-test
	.venv/bin/python -m pytest -q -p no:cacheprovider $(ARGS)

## Long tests, load tests and benchmark smoke runs.
test-slow: setup-test
	.venv/bin/python -m pytest -q -p no:cacheprovider -m slow $(ARGS)

lint: setup-test
	.venv/bin/ruff check kvpool tests
