# The checks .ci/run makes after setup: `make check` runs them all, in its order.
.PHONY: check lint test

check: lint test

lint:
	.venv/bin/ruff check .
	.venv/bin/mypy

test:
	.venv/bin/python -m pytest -q
