#!/usr/bin/env bash
# The whole suite as two pytest runs side by side: the tests marked `ray` (they start Ray: Serve applications,
# worker actors, `serve run`, `ray start`, a pip install before one) beside the rest. Those mostly wait on other
# processes, so the two runs share the cores well. Each run has a loopback-only network namespace of its own
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
mkdir "$work/ray" "$work/rest"
RAY_TMPDIR="$work/ray" "$here/loopback-netns.sh" "$python" -m pytest -m ray -p no:cacheprovider \
  --basetemp="$work/pytest-ray" "$@" >"$work/ray.log" 2>&1 &
with_ray=$!
RAY_TMPDIR="$work/rest" "$here/loopback-netns.sh" "$python" -m pytest -m "not ray" "$@"
rest=$?
wait "$with_ray"
ray_status=$?
echo
echo "==== the tests that start Ray (pytest -m ray), run beside the rest ===="
cat "$work/ray.log"
[ "$ray_status" = 5 ] && ray_status=0  # none collected (a selection without them)
[ "$rest" = 5 ] && rest=0
[ "$rest" != 0 ] && exit "$rest"
exit "$ray_status"
