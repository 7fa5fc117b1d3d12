# The two commands of the README. Each creates .venv on first use (scripts/setup.sh).
VENV := .venv
NPROC ?= 2
# pytest-xdist workers for `make test` (one test file per worker at a time); 0 runs in one process.
TEST_WORKERS ?= 2
ARGS ?=

.PHONY: venv pretrain test test-fast bench

venv:
	@bash scripts/setup.sh

## Main job: gpt_tiny on the Python standard library sources, TP=2 on 2 ranks, LOCAL + GLOBAL checkpoints.
pretrain: venv
	$(VENV)/bin/tierstack pretrain gpt_tiny --nproc-per-node $(NPROC) $(ARGS)

## All tests, multi-rank torchrun scenarios included.
test: venv
	$(VENV)/bin/python -m pytest tests -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

## Unit tests only (no torchrun scenarios).
test-fast: venv
	$(VENV)/bin/python -m pytest tests -q -m "not slow"
