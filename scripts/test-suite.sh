#!/usr/bin/env bash
# The whole suite as two pytest runs side by side: the tests marked `standalone` beside the rest. Each of those
# starts a server or cluster of its own in other processes (a pip install, `serve run`, `ray start`) and mostly
# waits on it, so the two runs share the cores (the rest computes: run beside each other, two runs of it would
# each take about twice as long). Each run has a loopback-only network namespace of its own
# (scripts/loopback-netns.sh: `serve run`'s ports 8000 and 9000 are free in each) and a Ray temp dir of its own
# (`ray start` records its cluster there, where a `ray.init()` of the other run would find it). Where there are no
# network namespaces (not root, no iproute2), one run does it all.
#
#   scripts/test-suite.sh PYTHON [pytest options...]
set -u
python=$1
shift
here=$(cd "$(dirname "$0")" && pwd)
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null 2>&1; then
  exec "$here/loopback-netns.sh" "$python" -m pytest "$@"
fi
# The embedded model's conversion, cached for both runs: two conversions at once would replace each other's.
HF_HUB_OFFLINE=1 "$python" -c "from pagedserve.workers.loader import resolve_model; resolve_model(None)" || exit 1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/standalone" "$work/rest"
RAY_TMPDIR="$work/standalone" "$here/loopback-netns.sh" "$python" -m pytest -m standalone -p no:cacheprovider \
  --basetemp="$work/pytest-standalone" "$@" >"$work/standalone.log" 2>&1 &
standalone=$!
RAY_TMPDIR="$work/rest" "$here/loopback-netns.sh" "$python" -m pytest -m "not standalone" "$@"
rest=$?
wait "$standalone"
standalone_status=$?
echo
echo "==== the standalone tests (pytest -m standalone), run beside the rest ===="
cat "$work/standalone.log"
[ "$standalone_status" = 5 ] && standalone_status=0  # none collected (a selection without them)
[ "$rest" = 5 ] && rest=0
[ "$rest" != 0 ] && exit "$rest"
exit "$standalone_status"
