#!/usr/bin/env bash
# What the monitoring tests drive besides the project, from Debian's packages: Prometheus (the package's binary alone,
# unpacked into DEST: installing the package would start a Prometheus server on every interface) and, as root,
# headless Chromium. Idempotent; where apt is not at hand it says so and the tests that need them skip.
#
#   scripts/install-test-tools.sh [DEST]     (default .tools)
set -uo pipefail

dest=${1:-.tools}
prometheus=$dest/prometheus/usr/bin/prometheus

if [ ! -x "$prometheus" ]; then
  if command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then
    mkdir -p "$dest/deb"
    (cd "$dest/deb" && rm -f prometheus_*.deb && apt-get download -q prometheus 2>/dev/null) &&
      dpkg-deb -x "$dest"/deb/prometheus_*.deb "$dest/prometheus" ||
      echo "install-test-tools: Debian's prometheus could not be fetched: the Prometheus test will skip" >&2
  else
    echo "install-test-tools: no apt-get: the Prometheus test will skip" >&2
  fi
fi

if ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends chromium >/dev/null ||
      { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends chromium >/dev/null; } ||
      echo "install-test-tools: Debian's chromium could not be installed: the dashboard test will skip" >&2
  else
    echo "install-test-tools: chromium needs root and apt-get to install: the dashboard test will skip" >&2
  fi
fi
exit 0
