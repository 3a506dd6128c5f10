#!/usr/bin/env bash
# Type-check the dfl_agent package (agent/ in the repository) with mypy; config in pyproject.toml.
#   scripts/mypy.sh [extra mypy options]      (MYPY=... picks another mypy command)
# The wheel maps agent/ -> dfl_agent and tools/ -> dfl_agent.cli (pyproject's package-dir), and the
# editable install resolves that with an import hook that mypy cannot follow. So this script lays
# the same mapping out as symlinks under build/mypy/ (rebuilt on every run, so new modules are
# seen) and points mypy there (mypy_path). Errors are reported under build/mypy/dfl_agent/...,
# which is agent/... in the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
root=build/mypy/dfl_agent
rm -rf build/mypy
mkdir -p "$root"
for entry in agent/*; do
  name=$(basename "$entry")
  [[ "$name" == __pycache__ ]] && continue
  ln -s "../../../$entry" "$root/$name"
done
ln -s ../../../tools "$root/cli"
exec ${MYPY:-.venv/bin/python -m mypy} "$@"
