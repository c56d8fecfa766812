#!/usr/bin/env bash
# The quick suite against distributed built from a source checkout (e.g. a
# snapshot of its development head), in a fresh virtualenv: does the next
# release still run dask-hoplite, and which features turn themselves off?
# Not part of CI (it needs a checkout); run it by hand and report.
#
#   bash ci/distributed_head.sh PATH   # PATH: a git clone or bare git dir of dask/distributed
#
# The commit at PATH's HEAD is exported (git archive) and installed with the
# version ``git describe`` gives it, with the dask its pyproject asks for from
# the package index; then dask-hoplite with its test extras, without letting
# pip change distributed. Prints the features that distributed leaves on,
# then runs ``pytest -m "not slow"``. Exits with pytest's status.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${1:?usage: ci/distributed_head.sh PATH-TO-DISTRIBUTED-GIT}
BASE_PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git_dir=$(git -C "$SRC" rev-parse --absolute-git-dir 2>/dev/null || echo "$SRC")
described=$(git --git-dir="$git_dir" describe --tags HEAD)   # e.g. 2026.7.0-10-g40fcd99a8
base=${described%%-*}
rest=${described#*-}
version="$base"
if [ "$rest" != "$described" ]; then
    version="$base.post${rest%%-*}+${rest#*-}"   # 2026.7.0.post10+g40fcd99a8
fi
echo "== distributed $described (installed as $version) from $SRC"
mkdir "$work/distributed"
git --git-dir="$git_dir" archive HEAD | tar -x -C "$work/distributed"
"$BASE_PY" -m venv "$work/venv"
PY=$work/venv/bin/python
SETUPTOOLS_SCM_PRETEND_VERSION=$version \
    "$PY" -m pip install --quiet --disable-pip-version-check "$work/distributed"
echo "distributed==$version" > "$work/constraints.txt"
"$PY" -m pip install --quiet --disable-pip-version-check -c "$work/constraints.txt" -e ".[test]"
"$PY" - <<'EOF'
import dask, distributed
from dask_hoplite.compat import check_distributed_version, find_drifts
from dask_hoplite.features import FeatureSet
print("dask", dask.__version__, "distributed", distributed.__version__)
print("version check:", check_distributed_version() or "tested range")
drifts = find_drifts()
print("class-level drifts:", [(d.feature, d.internal, d.problem) for d in drifts] or "none")
print("features on:", sorted(FeatureSet.decide(drifts).on))
EOF
"$PY" -m pytest -m "not slow" -p no:cacheprovider -q
