#!/usr/bin/env bash
# A Ray cluster of several nodes on this machine: each node in a network namespace of its own, joined to the others by
# a virtual link to a bridge (in a namespace of its own too), with addresses that exist only inside those namespaces
# (10.88.0.1 the head, 10.88.0.2, ... the others); and each node's processes in a PID namespace of its own, so that
# killing a node kills all of them at once, as losing the machine would. Needs root, iproute2 and util-linux.
#
#   scripts/netns-cluster.sh up NAME N [CPUS]     N nodes (NAME-0 the head), CPUS each (default 2); waits until all
#                                                 have joined; prints the head's address
#   scripts/netns-cluster.sh exec NAME I CMD...   CMD in node I's network namespace (RAY_ADDRESS set: a driver)
#   scripts/netns-cluster.sh kill NAME I          node I lost: every process on it killed at once
#   scripts/netns-cluster.sh start NAME I         node I started again (after kill), joining the head (the head
#                                                 declares the lost one dead on its own, after its health checks)
#   scripts/netns-cluster.sh link NAME I down|up  node I's link to the others down, or back up
#   scripts/netns-cluster.sh down NAME            every node stopped, every namespace and file removed
#
# RAY (default: the ray next to the python on PATH) is the ray command the nodes run; NODE_ARGS, more `ray start`
# arguments for every node (e.g. "--object-store-memory=300000000"); DASHBOARD=true starts Ray's dashboard on the head
# (127.0.0.1:8265 inside its namespace), which also writes the Prometheus configuration of the cluster's metrics
# endpoints (`$RAY_TMPDIR/ray/session_latest/metrics/prometheus/prometheus.yml`, RAY_TMPDIR as `exec` sets it).
set -euo pipefail

SUBNET=10.88.0
PORT=6379
STATE_ROOT=${NETNS_CLUSTER_STATE:-/run/pagedserve-netns-cluster}
RAY=${RAY:-$(dirname "$(command -v python)")/ray}
export RAY_AUTH_MODE=token  # the nodes and drivers share the token `ray start --head` keeps in ~/.ray

die() { echo "netns-cluster: $*" >&2; exit 1; }
addr() { echo "$SUBNET.$(($1 + 1))"; }
# Ray's temporary directory, short: the sockets Ray makes under it must fit a Unix socket path (107 bytes)
ray_tmp() { echo "/tmp/ray-$1"; }

start_node() {  # NAME I: the node's ray in its PID namespace, in the background; its first process's pid recorded
  local name=$1 i=$2 state=$STATE_ROOT/$1 join
  if [ "$i" = 0 ]; then
    join="--head --port=$PORT --include-dashboard=${DASHBOARD:-false} --dashboard-host=127.0.0.1"
  else
    join="--address=$(addr 0):$PORT"
  fi
  # `ray start --block` stays in the foreground while the node runs; the PID namespace ends with it.
  RAY_TMPDIR=$(ray_tmp "$name") setsid ip netns exec "$name-$i" unshare --pid --fork --mount-proc --kill-child \
    "$RAY" start --block $join --node-ip-address="$(addr "$i")" --num-cpus="$(cat "$state/cpus")" \
    --disable-usage-stats ${NODE_ARGS:-} >"$state/node-$i.log" 2>&1 &
  echo $! >"$state/node-$i.pid"
}

again_if_failed() {  # NAME I: node I started again if its `ray start` gave up, its log kept beside the new one
  # A node's `ray start` waits 30-45 s (Ray's own bounds) for its raylet to register with the head's GCS (the head's
  # with its own), which on loaded cores may take longer; it then exits, and the node never joins. A head started
  # again starts a new cluster: the others join it when they start, which they do only after it has.
  local name=$1 i=$2 state=$STATE_ROOT/$1
  kill -0 "$(cat "$state/node-$i.pid")" 2>/dev/null && return 0
  echo "netns-cluster: $name: node $i's ray start exited (its log: $state/node-$i.failed.log); starting it again" >&2
  mv "$state/node-$i.log" "$state/node-$i.failed.log"
  start_node "$name" "$i"
}

wait_started() {  # NAME I: until node I's `ray start` says its runtime runs (or 180 s)
  local log=$STATE_ROOT/$1/node-$2.log deadline=$((SECONDS + 180))
  until grep -q "Ray runtime started" "$log" 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || die "$1: node $2 did not start in 180 s (its log: $log)"
    again_if_failed "$1" "$2"
    sleep 0.5
  done
}

wait_nodes() {  # NAME N: until N nodes are alive in the cluster (or 180 s)
  local name=$1 n=$2 deadline=$((SECONDS + 180)) alive i
  while :; do
    alive=$(RAY_TMPDIR=$(ray_tmp "$name") ip netns exec "$name-0" "$(dirname "$RAY")/python" -c "
import ray
ray.init(address='$(addr 0):$PORT', logging_level='ERROR')
print(sum(node['Alive'] for node in ray.nodes()))" 2>/dev/null | tail -1) || true
    [ "${alive:-0}" = "$n" ] && return 0
    [ $SECONDS -lt $deadline ] || die "$name: ${alive:-0} of $n nodes alive after 180 s (logs: $STATE_ROOT/$name)"
    for ((i = 1; i < n; i++)); do again_if_failed "$name" "$i"; done
    sleep 1
  done
}

up() {  # NAME N [CPUS]
  local name=$1 n=$2 cpus=${3:-2} state=$STATE_ROOT/$1 i
  [ ! -e "$state" ] || die "$name is up already (down it first)"
  mkdir -p "$state" "$(ray_tmp "$name")"
  echo "$n" >"$state/nodes"
  echo "$cpus" >"$state/cpus"
  ip netns add "$name-sw"
  ip -n "$name-sw" link add br0 type bridge
  ip -n "$name-sw" link set br0 up
  for ((i = 0; i < n; i++)); do
    ip netns add "$name-$i"
    ip -n "$name-$i" link set lo up
    ip link add "ps$$-$i" type veth peer name "sw$$-$i"  # made here, each end moved into its namespace
    ip link set "ps$$-$i" netns "$name-$i" name eth0
    ip link set "sw$$-$i" netns "$name-sw" name "port$i"
    ip -n "$name-sw" link set "port$i" master br0 up
    ip -n "$name-$i" addr add "$(addr "$i")/24" dev eth0
    ip -n "$name-$i" link set eth0 up
  done
  start_node "$name" 0
  wait_started "$name" 0
  for ((i = 1; i < n; i++)); do start_node "$name" "$i"; done
  wait_nodes "$name" "$n"
  echo "$(addr 0):$PORT"
}

kill_node() {  # NAME I
  local pidfile=$STATE_ROOT/$1/node-$2.pid
  [ -e "$pidfile" ] || return 0
  kill -KILL -- "-$(cat "$pidfile")" 2>/dev/null || true  # its session: unshare, and with it the PID namespace
  rm -f "$pidfile"
}

down() {  # NAME
  local name=$1 state=$STATE_ROOT/$1 i n
  [ -e "$state" ] || return 0
  n=$(cat "$state/nodes")
  for ((i = 0; i < n; i++)); do kill_node "$name" "$i"; done
  for ((i = 0; i < n; i++)); do ip netns delete "$name-$i" 2>/dev/null || true; done
  ip netns delete "$name-sw" 2>/dev/null || true
  rm -rf "$state" "$(ray_tmp "$name")"
}

[ "$(id -u)" = 0 ] || die "needs root (network and PID namespaces)"
command -v ip >/dev/null && command -v unshare >/dev/null || die "needs iproute2's ip and util-linux's unshare"
cmd=${1:-}; shift || true
case $cmd in
  up) [ $# -ge 2 ] || die "usage: up NAME N [CPUS]"; up "$@" ;;
  exec) [ $# -ge 3 ] || die "usage: exec NAME I CMD..."
        name=$1 i=$2; shift 2
        RAY_ADDRESS=$(addr 0):$PORT RAY_TMPDIR=$(ray_tmp "$name") exec ip netns exec "$name-$i" "$@" ;;
  kill) [ $# = 2 ] || die "usage: kill NAME I"; kill_node "$1" "$2" ;;
  start) [ $# = 2 ] || die "usage: start NAME I"; start_node "$1" "$2"; wait_started "$1" "$2" ;;
  link) [ $# = 3 ] || die "usage: link NAME I down|up"; ip -n "$1-sw" link set "port$2" "$3" ;;
  down) [ $# = 1 ] || die "usage: down NAME"; down "$1" ;;
  *) die "usage: up NAME N [CPUS] | exec NAME I CMD... | kill NAME I | start NAME I | link NAME I down|up |" \
         "down NAME" ;;
esac
