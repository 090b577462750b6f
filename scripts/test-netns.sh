#!/usr/bin/env bash
# make test-netns: a router and a `llamapool node` across a real network boundary on one machine.
#
# Two network namespaces joined by a veth pair (addresses only inside them): the router daemon in
# one, the node in the other (tests/test_netns.py). Scenarios: the node joins and serves; partition
# (ip link set ... down): its workers are lost within 3 heartbeats, unstarted requests go to the
# local worker, streams in flight end with worker_lost, every request gets one final reply; link up:
# the node rejoins and serves; router restart: the node reconnects, its workers untouched.
# Prints each figure (FIGURE lines) and cleans up the namespaces whatever happens. Needs root and ip.
#
#   scripts/test-netns.sh                  # uses .venv/bin/python, or $PYTHON
#   REPORT=out.jsonl scripts/test-netns.sh # also write the figures as JSON lines
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ "$(id -u)" = 0 ] || { echo "test-netns: needs root (ip netns)" >&2; exit 1; }
command -v ip >/dev/null || { echo "test-netns: needs ip (apt-get install iproute2)" >&2; exit 1; }
cd "$ROOT"
echo "test-netns: $(date -u +%Y-%m-%dT%H:%M:%SZ) $(uname -r), $(nproc) CPU(s), $("$PY" --version)"
LLAMAPOOL_NETNS=1 LLAMAPOOL_NETNS_REPORT="${REPORT:-}" exec "$PY" -m pytest -v -s -p no:cacheprovider -m netns \
    tests/test_netns.py
