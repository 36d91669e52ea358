#!/usr/bin/env bash
# Runs command N of the README's quick start exactly as the README writes it.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=$(awk '/<!-- quickstart -->/{f=1;next} /<!-- \/quickstart -->/{f=0} f && /^(pip|python)/' README.md | sed -n "${1}p")
[ -n "$cmd" ] || { echo "README quick start command $1 not found" >&2; exit 1; }
echo "+ $cmd"
eval "$cmd"
