# The checks .ci/run makes after setup: `make check` runs them all, in its order.
.PHONY: check lint test test-slow test-all

check: lint test

lint:
	.venv/bin/ruff check .
	.venv/bin/mypy

test:
	.venv/bin/python -m pytest -q

# the tests the default run leaves out (marked `slow`), and every test
test-slow:
	.venv/bin/python -m pytest -q -m slow

test-all:
	.venv/bin/python -m pytest -q -m ""
