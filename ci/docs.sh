#!/usr/bin/env bash
# Build the documentation with warnings as errors.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
echo "== docs"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[docs]"
"$PY" -m sphinx -W --keep-going -q -b html docs docs/_build/html
echo "docs built in docs/_build/html"
