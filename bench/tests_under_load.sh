#!/usr/bin/env bash
# Run chosen tests N times in a row while busy loops keep every core at 100% (a test's verdict
# must not depend on the machine's load). Usage:
#   bash bench/tests_under_load.sh 10 tests/quiver/test_hetero_updates.py -k "one_version or sigkill"
set -u
n=${1:-10}; shift
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
hogs=()
for _ in $(seq "$(nproc)"); do ( while :; do :; done ) & hogs+=($!); done
trap 'kill "${hogs[@]}" 2>/dev/null' EXIT
pass=0
for i in $(seq "$n"); do
  if HF_HUB_OFFLINE=1 "$PY" -m pytest -q -p no:cacheprovider "$@" > /tmp/tests_under_load.$i.log 2>&1; then
    pass=$((pass + 1))
  fi
  echo "run $i: $pass passed so far; $(tail -1 /tmp/tests_under_load.$i.log)"
done
echo "$pass of $n runs passed under load ($(nproc) busy loops)"
[ "$pass" -eq "$n" ]
