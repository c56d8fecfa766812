#!/usr/bin/env bash
# Build the sdist and the wheel, check them, install the wheel in a fresh
# virtualenv (no checkout on its path) and run the demo on a local cluster with it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
echo "== package: build and check"
"$PY" -m pip install --quiet --disable-pip-version-check build twine
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$PY" -m build --sdist --wheel --outdir "$out/dist" . >"$out/build.log" 2>&1 || { cat "$out/build.log"; exit 1; }
"$PY" -m twine check --strict "$out"/dist/*
# The wheel holds the package data the plugin loads (defaults, type marker) and no tests.
"$PY" - "$out"/dist/*.whl <<'PYEOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
for needed in ("dask_hoplite/hoplite.yaml", "dask_hoplite/py.typed", "dask_hoplite/dashboard/page.py"):
    assert needed in names, f"{needed} missing from the wheel"
assert not any(n.startswith(("tests/", "benchmarks/")) for n in names), "stray files in the wheel"
print("wheel contents ok:", len(names), "files")
PYEOF
echo "== package: the wheel in a fresh virtualenv runs the demo"
"$PY" -m venv "$out/venv"
"$out/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$out"/dist/*.whl
cd "$out"  # no checkout on the path: the wheel's dask_hoplite is the one imported
"$out/venv/bin/python" "$OLDPWD/examples/demo.py" --local --workers 3 --size 32MiB | tee "$out/demo.log"
grep -q "from $out/venv/" "$out/demo.log" || { echo "the demo did not run the wheel's dask_hoplite"; exit 1; }
grep -q "results identical: yes" "$out/demo.log"
