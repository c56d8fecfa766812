#!/usr/bin/env bash
# Install dask-hoplite with its test extras and run every check: lint, types,
# the default test suite, then the slow tests. Exits non-zero on any failure.
# README's test command and CI (.ci/run) both run exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[test]"
echo "== ruff"
"$PY" -m ruff check dask_hoplite tests benchmarks examples
echo "== mypy"
"$PY" -m mypy
echo "== pytest (default suite)"
"$PY" -m pytest -m "not slow" -p no:cacheprovider
echo "== pytest (slow)"
set +e
"$PY" -m pytest -m slow -p no:cacheprovider
rc=$?
set -e
# pytest exits 5 when no test carries the mark; that is not a failure.
if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
