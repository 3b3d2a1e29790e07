# Entry points for development and CI. Every tool runs from the virtualenv by path, never
# from an activated shell, so that `make test` behaves the same everywhere.

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := test

VENV ?= .venv
BIN := $(VENV)/bin
# Re-install when pyproject.toml changes: the stamp is older than it then.
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# The first of these that is Python >= 3.11 (evaluated only when a venv must be created).
PYTHON ?= $(shell for p in python3 python3.13 python3.12 python3.11; do \
	$$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1 \
	&& { command -v $$p; break; }; done)

.PHONY: system-deps venv test lint typecheck docs test-reliability test-matrix check-wheel demo bench \
	format clean matrix-clean distclean

# Debian packages the suite needs (mongod's libraries, Chromium for the browser tests).
system-deps:
	bash scripts/system-deps.sh

venv: $(STAMP)

$(STAMP): pyproject.toml
	@if ! $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then \
		if [ -z "$(PYTHON)" ]; then \
			echo "error: no Python >= 3.11 found; install one or pass PYTHON=/path/to/python3" >&2; \
			exit 1; \
		fi; \
		echo "Creating $(VENV) with $(PYTHON) ($$($(PYTHON) --version))"; \
		rm -rf $(VENV); \
		$(PYTHON) -m venv $(VENV); \
	fi
	$(BIN)/python -m pip install --disable-pip-version-check --progress-bar off --upgrade pip
	$(BIN)/python -m pip install --disable-pip-version-check --progress-bar off -e '.[test,docs,demo]'
	touch $(STAMP)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-logo --no-cache

typecheck: venv
	$(BIN)/mypy django_mongolock testproject tests benchmarks

docs: venv
	$(BIN)/mkdocs build --strict

# The tests' temporary files, mongod's data among them, live in memory where the machine has a
# tmpfs (scripts/test-tmpdir.sh): a disk that stalls would end the tests' short leases.
# Coverage starts before pytest: pytest imports entry-point plugins, django_mongolock.testing
# among them (and so the whole package), before pytest-cov's --cov could start measuring.
# pytest exits 5 when it collected nothing: that is a failure here, and said so.
test: system-deps lint typecheck docs
	@status=0; \
	echo "$(BIN)/coverage run --source=django_mongolock -m pytest $(PYTEST_ARGS)"; \
	bash scripts/test-tmpdir.sh $(BIN)/coverage run --source=django_mongolock -m pytest $(PYTEST_ARGS) \
		|| status=$$?; \
	if [ $$status -eq 5 ]; then echo "error: pytest collected no tests" >&2; fi; \
	if [ $$status -ne 0 ]; then exit $$status; fi; \
	echo "$(BIN)/coverage report --fail-under=85"; \
	$(BIN)/coverage report --fail-under=85

# The fault tests against real mongod processes (failover, crashes, clock skew under faketime,
# outages, pauses, load); `make test` leaves them out. Collecting nothing (exit 5) fails too.
test-reliability: system-deps venv
	@status=0; \
	echo "$(BIN)/pytest tests/reliability $(PYTEST_ARGS)"; \
	bash scripts/test-tmpdir.sh $(BIN)/pytest tests/reliability $(PYTEST_ARGS) || status=$$?; \
	if [ $$status -eq 5 ]; then echo "error: pytest collected no reliability tests" >&2; fi; \
	exit $$status

# The suite on every supported Python x Django x pymongo row, each on a fresh clone of HEAD
# (scripts/matrix.sh; docs/contributing.md). Python 3.13 and 3.14 run in minimal Debian roots
# that scripts/chroot.sh builds once (as root). MATRIX_ROWS="a b" runs some rows only.
test-matrix: system-deps
	bash scripts/matrix.sh

# The built wheel in a clean venv: contents, manage.py check, migrate_mongolock, a locked command.
check-wheel: system-deps
	bash scripts/check-wheel.sh

demo: venv
	$(BIN)/python scripts/demo.py

# The benchmark suite, with its peers: python-redis-lock (the bench extra) on a local
# redis-server (installed with apt when missing, as root; skipped with a notice otherwise).
bench: venv
	$(BIN)/python -m pip install --disable-pip-version-check --progress-bar off -q -e '.[bench]'
	@command -v redis-server >/dev/null 2>&1 || { [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& apt-get install -y -q --no-install-recommends redis-server; } || true
	$(BIN)/python benchmarks/run.py

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Build output and caches; `distclean` also drops the virtualenv and the demo's MongoDB data.
# The matrix's Debian roots stay (minutes to rebuild): `make matrix-clean` removes them.
clean:
	rm -rf build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .coverage htmlcov docs/site
	find . \( -path ./$(VENV) -o -path ./.matrix \) -prune -o -name __pycache__ -type d -prune \
		-exec rm -rf {} +

# Never a plain rm -rf: a root may still have the host's /dev and /sys mounted in it.
matrix-clean:
	bash scripts/chroot.sh remove .matrix

distclean: clean
	rm -rf $(VENV) .mongodb
