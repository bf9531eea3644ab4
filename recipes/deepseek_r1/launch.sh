#!/usr/bin/env bash
# Run a DeepSeek-R1 recipe config on this node (the same command on every node of the run):
#   MASTER_ADDR=<head address> recipes/deepseek_r1/launch.sh a3-128-true-weight [key=value ...] [--dry-run]
# A thin wrapper: everything happens in `python -m tools.launch` (see its --help).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
name="${1:?usage: launch.sh CONFIG_NAME [key=value ...] [--dry-run]  (configs: $(cd "$here/configs" && ls *.yaml | sed 's/.yaml//' | tr '\n' ' '))}"
shift
config="$here/configs/${name%.yaml}.yaml"
python="${PYTHON:-$root/.venv/bin/python}"
cd "$root"
exec "$python" -m tools.launch "$config" "$@"
