#!/usr/bin/env bash
# Install dask-hoplite with its test extras into a fresh virtualenv and run
# every check there: lint, types, the default test suite, the slow tests, the
# default suite again against the oldest distributed it supports (in a second
# fresh virtualenv: dask and distributed at compat.TESTED_RANGE's lower bound), the
# package (sdist and wheel built, checked, the wheel installed in a fresh
# virtualenv running the demo), README's demo command (ci/demo.sh) and the docs
# (built with warnings as errors). Exits non-zero on any failure.
# README's test command and CI (.ci/run) both run exactly this.
#
# The virtualenv is made anew on every run from $PYTHON (default python3), so
# the suite sees only what the project declares, whatever the machine had
# before. It lives in a temporary folder, removed at exit; set
# HOPLITE_CI_VENV=DIR to keep it there instead (DIR is emptied first).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_PY=${PYTHON:-python3}
if [ -n "${HOPLITE_CI_VENV:-}" ]; then
    venv=$HOPLITE_CI_VENV
else
    venv=$(mktemp -d)/venv
    trap 'rm -rf "$(dirname "$venv")"' EXIT
fi
echo "== fresh virtualenv in $venv (from $("$BASE_PY" -c 'import sys; print(sys.executable)'))"
rm -rf "$venv"
"$BASE_PY" -m venv "$venv"
PY=$venv/bin/python
# ci/package.sh, ci/demo.sh and ci/docs.sh run with this interpreter too.
export PYTHON=$PY
# The /hoplite page is tested in Debian's headless chromium (with chromedriver).
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "== apt-get install chromium chromium-driver"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
    else
        echo "chromium and chromium-driver are not installed and cannot be (needs root and apt-get);"
        echo "the browser test will be skipped outside CI."
    fi
fi
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[test]"
echo "== ruff"
"$PY" -m ruff check dask_hoplite tests benchmarks examples docs
"$PY" -m ruff format --check dask_hoplite tests benchmarks examples docs
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
# The oldest release the package admits, in a virtualenv of its own (the
# newest, or whatever the index serves, ran above).
oldest=$("$PY" -c "from dask_hoplite.compat import TESTED_RANGE; print(TESTED_RANGE[0])")
old_venv=$(dirname "$venv")/venv-distributed-$oldest
echo "== pytest (default suite) on dask and distributed $oldest, fresh virtualenv $old_venv"
rm -rf "$old_venv"
"$BASE_PY" -m venv "$old_venv"
printf 'dask==%s\ndistributed==%s\n' "$oldest" "$oldest" > "$old_venv/constraints.txt"
"$old_venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    -c "$old_venv/constraints.txt" -e ".[test]"
"$old_venv/bin/python" -c "import distributed; assert distributed.__version__ == '$oldest', distributed.__version__"
"$old_venv/bin/python" -m pytest -m "not slow" -p no:cacheprovider
rm -rf "$old_venv"
bash ci/package.sh
bash ci/demo.sh
bash ci/docs.sh
