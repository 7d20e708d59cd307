#!/usr/bin/env bash
# Run a command in a fresh network namespace that has only loopback, where we can (root + iproute2).
# Ray and Ray Serve bind every interface and address the node by its interface IP; inside this
# namespace the only address is 127.0.0.1, so everything the tests start listens and talks on loopback.
set -u
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null 2>&1 && [ -z "${PAGEDSERVE_NETNS:-}" ]; then
  ns="pagedserve-$$"
  if ip netns add "$ns" 2>/dev/null; then
    trap 'ip netns delete "$ns" 2>/dev/null' EXIT
    ip netns exec "$ns" ip link set lo up
    PAGEDSERVE_NETNS="$ns" ip netns exec "$ns" "$@"
    exit $?
  fi
fi
echo "loopback-netns: no network namespace available; running directly" >&2
exec "$@"
