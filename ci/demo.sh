#!/usr/bin/env bash
# Run README's demo command exactly as written, as a new user would: in a fresh
# copy of this checkout (no virtualenv, build or cache of earlier runs in it),
# so that it works with nothing but what the `demo` extra declares. Exits
# non-zero when the command fails or the demo's results differ.
set -euo pipefail
cd "$(dirname "$0")/.."
# The one line of README's "Try it" that runs examples/demo.py.
cmd=$(grep -E '^[^#]*examples/demo\.py' README.md | head -n 1)
[ -n "$cmd" ] || { echo "README.md has no command that runs examples/demo.py"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar --exclude=./.git --exclude=./.venv --exclude='*.egg-info' --exclude=__pycache__ \
    --exclude=./docs/_build --exclude=./build --exclude=./dist -cf - . | tar -xf - -C "$work"
echo "== README's demo command in a fresh copy: $cmd"
(cd "$work" && bash -c "$cmd") | tee "$work/demo.log"
grep -q "results identical: yes" "$work/demo.log"
