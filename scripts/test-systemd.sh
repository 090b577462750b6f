#!/usr/bin/env bash
# make test-systemd: configs/systemd/llamapool.service under a real systemd (PID 1 in a
# systemd-nspawn container, see docs/systemd.md), checked with systemctl and journalctl inside it.
#
#   1. start: the unit is "activating" while the workers load and "active" only after READY=1,
#      with the daemon's STATUS= text in `systemctl status`;
#   2. reload (SIGHUP) under load: every worker replaced, 0 failed requests;
#   3. watchdog: a supervisor frozen with SIGSTOP is killed by systemd and restarted;
#   4. logs reach the journal with their priority (a killed worker's "died" line is a warning);
#   5. stop drains (a request in flight completes) and leaves no process of the service;
#   6. a pool whose every worker fails at start-up (a missing model) exits 78: `systemctl start`
#      fails, `systemctl status` shows why, and systemd does not restart it;
#   7. `systemd-analyze security llamapool.service`.
#
# Needs root, network access for apt/debootstrap on the first run (a Debian 12 tree with systemd and
# python3 in $MACHINE, kept for later runs), and the checkout's venv (`make install`). The container
# runs the checkout's code: its /opt/llamapool/.venv is a venv of the container's python3 that
# imports the host venv's packages (both CPython 3.11). The unit is the shipped one, with two test
# drop-ins: WatchdogSec=6 (30 s shipped, to keep the run short) and the config path.
# Prints what it checked; exit 0 only when every check passed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MACHINE="${MACHINE:-/var/lib/machines/llamapool-test}"
UNIT=llamapool.service
FAILED=0
LOG="$(mktemp -d)"

say() { printf '%s\n' "$*"; }
pass() { say "PASS: $*"; }
fail() { say "FAIL: $*"; FAILED=$((FAILED + 1)); }
die() { say "ERROR: $*"; exit 2; }
# a unit's MainPID: a positive pid, or an error (never signal pid 0: that is this script's process group)
mainpid() {
    local p; p=$(prop MainPID)
    [[ "$p" =~ ^[1-9][0-9]*$ ]] || { say "FAIL: $UNIT has no main process (MainPID=$p): stopping here" >&2; return 1; }
    echo "$p"
}

[ "$(id -u)" = 0 ] || die "needs root (systemd-nspawn)"
[ -x "$ROOT/.venv/bin/python" ] || die "no venv: run make install first"
"$ROOT/.venv/bin/python" -c 'import sys; assert sys.version_info[:2] == (3, 11)' ||
    die "the host venv must be CPython 3.11 (the container's python3 is Debian 12's 3.11)"

# --- the container tree (once) -----------------------------------------------------------------
if ! command -v systemd-nspawn >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get install -y -q systemd-container debootstrap >/dev/null 2>&1 ||
        { apt-get update -q >/dev/null && apt-get install -y -q systemd-container debootstrap >/dev/null; } ||
        die "cannot install systemd-container and debootstrap"
fi
if [ ! -x "$MACHINE/usr/bin/python3" ] || [ ! -x "$MACHINE/lib/systemd/systemd" ]; then
    say "debootstrap: a minimal Debian 12 with systemd and python3 in $MACHINE (a few minutes, once)"
    MIRROR=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null)
    debootstrap --variant=minbase --include=systemd,systemd-sysv,dbus,python3,procps,libgomp1 bookworm \
        "$MACHINE" "${MIRROR:-http://deb.debian.org/debian}" >"$LOG/debootstrap.log" 2>&1 ||
        { tail -20 "$LOG/debootstrap.log"; die "debootstrap failed"; }
fi

# libgomp1: llama.cpp's CPU backend links OpenMP (a tree from an earlier run may lack it)
[ -n "$(find "$MACHINE/usr/lib" -name 'libgomp.so.1' -print -quit)" ] ||
    chroot "$MACHINE" apt-get install -y -q libgomp1 >/dev/null || die "cannot install libgomp1 in $MACHINE"

# --- what the unit expects: user, venv, config, model -------------------------------------------
chroot "$MACHINE" id llamapool >/dev/null 2>&1 ||
    chroot "$MACHINE" useradd --system --home /var/lib/llamapool --shell /usr/sbin/nologin llamapool
SITE="$("$ROOT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -rf "$MACHINE/opt/llamapool/.venv"
chroot "$MACHINE" python3 -m venv --without-pip /opt/llamapool/.venv
CSITE="$(chroot "$MACHINE" /opt/llamapool/.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# The checkout is bound at /opt/llamapool/checkout, outside /tmp: the unit's PrivateTmp=yes hides /tmp,
# so a checkout under /tmp bound at its own path would not be seen by the service.
CHECKOUT=/opt/llamapool/checkout
case "$SITE" in "$ROOT"/*) ;; *) die "the venv's site-packages ($SITE) must be inside the checkout ($ROOT)";; esac
mkdir -p "$MACHINE$CHECKOUT"
printf '%s\nimport site; site.addsitedir(%s)\n' "$CHECKOUT/src" "'$CHECKOUT${SITE#"$ROOT"}'" \
    >"$MACHINE$CSITE/llamapool-host.pth"
cat >"$MACHINE/opt/llamapool/.venv/bin/llamapool" <<'EOF'
#!/opt/llamapool/.venv/bin/python
import sys
from llamapool.cli import main
sys.exit(main())
EOF
chmod 0755 "$MACHINE/opt/llamapool/.venv/bin/llamapool"
mkdir -p "$MACHINE/srv/llamapool/models" "$MACHINE/etc/llamapool"
"$ROOT/.venv/bin/llamapool" make-model "$MACHINE/srv/llamapool/models/demo.gguf" >/dev/null  # random, tiny
cat >"$MACHINE/etc/llamapool/llamapool.toml" <<'EOF'
[model]
path = "/srv/llamapool/models/demo.gguf"
ctx_per_slot = 512

[workers]
devices = "cpu"
cpu_workers = 2
slots = 4
threads = 1
EOF
sed 's|^path = .*|path = "/srv/llamapool/models/missing.gguf"|' "$MACHINE/etc/llamapool/llamapool.toml" \
    >"$MACHINE/etc/llamapool/broken.toml"
install -m 0644 "$ROOT/configs/systemd/$UNIT" "$MACHINE/etc/systemd/system/$UNIT"
mkdir -p "$MACHINE/etc/systemd/system/$UNIT.d"
printf '[Service]\nWatchdogSec=6\n' >"$MACHINE/etc/systemd/system/$UNIT.d/test.conf"
cat >"$MACHINE/usr/local/bin/lp-load" <<'EOF'
#!/opt/llamapool/.venv/bin/python
"""lp-load SECONDS THREADS: requests over the SDK until SECONDS pass; prints ok=N failed=M."""
import sys, threading, time
from llamapool.client import Client
seconds, threads = float(sys.argv[1]), int(sys.argv[2])
ok, failed, errors, lock = [0], [0], [], threading.Lock()
def run(i):
    end = time.monotonic() + seconds
    with Client("ipc:///run/llamapool/frontend.sock", timeout=60) as c:
        while time.monotonic() < end:
            try:
                c.generate(f"request {i}", max_tokens=16)
                with lock: ok[0] += 1
            except Exception as e:  # every failure counts
                with lock: failed[0] += 1; errors.append(repr(e))
                time.sleep(0.5)
ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
[t.start() for t in ts]; [t.join() for t in ts]
print(f"ok={ok[0]} failed={failed[0]}", *errors[:3])
EOF
chmod 0755 "$MACHINE/usr/local/bin/lp-load"

rm -rf "$MACHINE"/var/log/journal/*  # this run's journal only

# --- boot it -------------------------------------------------------------------------------------
mkdir -p /run/systemd/nspawn
mountpoint -q /run/systemd/nspawn || mount -t tmpfs tmpfs /run/systemd/nspawn
mkdir -p /run/dbus
[ -S /run/dbus/system_bus_socket ] || dbus-daemon --system --fork
systemd-nspawn -D "$MACHINE" --register=no --keep-unit -b --bind-ro="$ROOT:$CHECKOUT" >"$LOG/nspawn.log" 2>&1 &
NSPAWN=$!
cleanup() { kill "$NSPAWN" 2>/dev/null; wait "$NSPAWN" 2>/dev/null; rm -rf "$LOG"; }
trap cleanup EXIT
# PID 1 of the container: the child of nspawn that runs systemd (nspawn may fork a helper first)
leader() { ps -o pid=,comm= --ppid "$NSPAWN" 2>/dev/null | awk '$2 == "systemd" {print $1; exit}'; }
ct() { nsenter -t "$LEADER" -a "$@"; }
LEADER="" state=""
deadline=$(( $(date +%s) + 90 ))
while (( $(date +%s) < deadline )); do  # the bus appears a moment after PID 1 starts
    LEADER=$(leader)
    if [[ -n "$LEADER" ]]; then
        state="$(timeout 60 nsenter -t "$LEADER" -a systemctl is-system-running --wait 2>&1)"
        [[ "$state" == running || "$state" == degraded ]] && break
    fi
    kill -0 "$NSPAWN" 2>/dev/null || break
    sleep 0.5
done
[[ "$state" == running || "$state" == degraded ]] || { cat "$LOG/nspawn.log"; die "systemd in the container: $state"; }
say "container: systemd $(ct systemctl --version | head -1 | awk '{print $2}') is $state (PID 1 = pid $LEADER on the host)"
prop() { ct systemctl show -p "$1" --value "$UNIT"; }
ts() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(ts)" 'BEGIN { printf "%.1f", b - a }'; }

# --- 1. start: active only after READY=1, with STATUS= ----------------------------------------------
say ""; say "== 1. systemctl start"
t0=$(ts)
ct systemctl start --no-block "$UNIT"
seen=""
deadline=$(( $(date +%s) + 120 ))
while (( $(date +%s) < deadline )); do
    s=$(prop ActiveState)
    [[ " $seen " == *" $s "* ]] || seen="$seen $s"
    [[ "$s" == active || "$s" == failed ]] && break
    sleep 0.1
done
say "states seen:$seen (after $(since "$t0") s)"
say "$(ct systemctl status "$UNIT" --no-pager | sed -n '1,6p')"
journal="$(ct journalctl -b -u "$UNIT" -o cat --no-pager)"
ready_line=$(grep -n "llamapool: ready (READY=1)" <<<"$journal" | head -1 | cut -d: -f1)
started_line=$(grep -n "^Started " <<<"$journal" | head -1 | cut -d: -f1)
if [[ "$seen" == *activating* && "$(prop ActiveState)" == active && -n "$ready_line" && -n "$started_line" &&
      "$ready_line" -lt "$started_line" ]]; then
    pass "activating while loading, active only after the daemon's READY=1 (its 'ready' log line precedes systemd's 'Started')"
else
    fail "start: states '$seen', ready line ${ready_line:-none}, Started line ${started_line:-none}"
fi
status_text="$(prop StatusText)"
[[ "$status_text" == *"workers ready"* ]] && pass "STATUS=\"$status_text\"" || fail "StatusText '$status_text'"

# --- 2. reload under load -------------------------------------------------------------------------
say ""; say "== 2. systemctl reload under load"
main=$(mainpid) || exit 1
before=$(ct pgrep -P "$main" -f llamapool.worker | sort | tr '\n' ' ')
ct lp-load 20 6 >"$LOG/load.txt" 2>&1 &
LOAD=$!
sleep 3
done_before=$(ct journalctl -b -u "$UNIT" -o cat --no-pager | grep -c "llamapool: reload done")
t0=$(ts)
ct systemctl reload "$UNIT"
seen=""
deadline=$(( $(date +%s) + 60 ))
while (( $(date +%s) < deadline )); do
    s=$(prop ActiveState)
    [[ " $seen " == *" $s "* ]] || seen="$seen $s"
    (( $(ct journalctl -b -u "$UNIT" -o cat --no-pager | grep -c "llamapool: reload done") > done_before )) &&
        [[ "$s" == active ]] && break
    sleep 0.1
done
reload_s=$(since "$t0")
say "states seen:$seen; reload took $reload_s s"
say "$(ct journalctl -b -u "$UNIT" -o cat --no-pager | grep -E "Reloading|Reloaded|reloading:|reload done|started pid|exited" | tail -8)"
after=$(ct pgrep -P "$main" -f llamapool.worker | sort | tr '\n' ' ')
wait "$LOAD"
load="$(cat "$LOG/load.txt")"
say "worker pids before: $before; after: $after; load: $load"
if [[ -n "$before" && -n "$after" && -z "$(comm -12 <(tr ' ' '\n' <<<"$before" | sed '/^$/d') <(tr ' ' '\n' <<<"$after" | sed '/^$/d'))" ]]; then
    pass "reload done in $reload_s s, every worker replaced, same main pid $(prop MainPID)"
else
    fail "reload: states '$seen', workers before '$before' after '$after'"
fi
[[ "$load" =~ ok=([0-9]+)\ failed=0 && "${BASH_REMATCH[1]}" -gt 0 ]] &&
    pass "0 failed requests during the reload ($load)" || fail "requests during the reload: $load"

# --- 3. watchdog ------------------------------------------------------------------------------------
say ""; say "== 3. watchdog: SIGSTOP the supervisor"
main=$(mainpid) || exit 1
n0=$(prop NRestarts)
t0=$(ts)
ct kill -STOP "$main"
detected=""
deadline=$(( $(date +%s) + 90 ))
while (( $(date +%s) < deadline )); do
    if [[ -z "$detected" ]] && ct journalctl -b -u "$UNIT" -o cat --no-pager | grep "Watchdog timeout" >/dev/null; then
        detected=$(since "$t0")
    fi
    [[ "$(prop NRestarts)" -gt "$n0" && "$(prop ActiveState)" == active ]] && break
    sleep 0.2
done
new=$(prop MainPID)
say "$(ct journalctl -b -u "$UNIT" -o cat --no-pager | grep -E "Watchdog timeout|Killing process|Scheduled restart|Main process exited" | tail -4)"
if [[ -n "$detected" && "$new" != "$main" && "$(prop ActiveState)" == active ]]; then
    pass "frozen pid $main killed by the watchdog after ${detected} s (WatchdogSec=6); pid $new active again $(since "$t0") s after SIGSTOP; NRestarts=$(prop NRestarts)"
else
    fail "watchdog: detected '${detected}', main $main -> $new, state $(prop ActiveState)"
fi
ct lp-load 2 2 | grep "failed=0" >/dev/null && pass "the restarted service serves" || fail "no service after the watchdog restart"

# --- 4. priorities in the journal ---------------------------------------------------------------------
say ""; say "== 4. journal priorities"
main=$(mainpid) || exit 1
victim=$(ct pgrep -P "$main" -f llamapool.worker | head -1)
ct kill -KILL "$victim"
sleep 3
warn="$(ct journalctl -b -u "$UNIT" -p warning -o cat --no-pager | grep "pid $victim died" | head -1)"
info_only="$(ct journalctl -b -u "$UNIT" -p 6..6 -o cat --no-pager)"
say "priority 4 (warning): $warn"
say "priority 6 (info):    $(grep -m1 "llamapool: ready" <<<"$info_only")"
if [[ -n "$warn" ]] && ! grep -q "pid $victim died" <<<"$info_only" && grep -q "llamapool: ready" <<<"$info_only"; then
    pass "a worker's death is logged at warning, readiness at info (journald PRIORITY from the <N> prefix)"
else
    fail "priorities: warning line '$warn'"
fi
prio=$(ct journalctl -b -u "$UNIT" -o json --no-pager | "$ROOT/.venv/bin/python" -c '
import json, sys
for line in sys.stdin:
    e = json.loads(line)
    if "died" in str(e.get("MESSAGE", "")):
        print(e.get("PRIORITY")); break')
[[ "$prio" == 4 ]] && pass "journalctl -o json: PRIORITY=4 on the 'died' entry" || fail "PRIORITY '$prio'"

# --- 5. stop drains and leaves nothing -------------------------------------------------------------------
say ""; say "== 5. systemctl stop with a request in flight"
sleep 2
ct /opt/llamapool/.venv/bin/python -c '
from llamapool.client import Client
with Client("ipc:///run/llamapool/frontend.sock", timeout=60) as c:
    r = c.generate("drain me", max_tokens=300, ignore_eos=True)
    print(f"in-flight request: {r.usage.completion_tokens} tokens, finish_reason={r.finish_reason}")
' >"$LOG/drain.txt" 2>&1 &
DRAIN=$!
sleep 1
t0=$(ts)
ct systemctl stop "$UNIT"
stop_s=$(since "$t0")
wait "$DRAIN"
left=$(ct pgrep -u llamapool | tr '\n' ' ')
say "$(cat "$LOG/drain.txt"); stop took $stop_s s; Result=$(prop Result), ExecMainStatus=$(prop ExecMainStatus)"
grep -q "300 tokens" "$LOG/drain.txt" && pass "the in-flight request completed during the drain" ||
    fail "drain: $(cat "$LOG/drain.txt")"
[[ -z "$left" && "$(prop ActiveState)" == inactive && "$(prop Result)" == success ]] &&
    pass "inactive, Result=success, no process of user llamapool left" ||
    fail "after stop: state $(prop ActiveState), result $(prop Result), processes left: '$left'"

# --- 6. every worker failed at start-up: exit 78 ------------------------------------------------------
say ""; say "== 6. a missing model"
printf '[Service]\nExecStart=\nExecStart=/opt/llamapool/.venv/bin/llamapool serve --config /etc/llamapool/broken.toml\n' \
    >"$MACHINE/etc/systemd/system/$UNIT.d/broken.conf"
ct systemctl daemon-reload
ct systemctl reset-failed "$UNIT" 2>/dev/null
t0=$(ts)
if ct systemctl start "$UNIT" 2>"$LOG/start.err"; then
    fail "systemctl start succeeded with a missing model"
else
    pass "systemctl start failed after $(since "$t0") s: $(head -1 "$LOG/start.err")"
fi
sleep 7  # longer than RestartSec=5: no restart may follow
status="$(ct systemctl status "$UNIT" --no-pager 2>&1)"
say "$status" | sed -n '1,12p'
[[ "$(prop ExecMainStatus)" == 78 && "$(prop ActiveState)" == failed && "$(prop NRestarts)" == 0 ]] &&
    pass "exit status 78, state failed, not restarted (RestartPreventExitStatus=78)" ||
    fail "state $(prop ActiveState), status $(prop ExecMainStatus), restarts $(prop NRestarts)"
grep -q "every worker failed at start-up" <<<"$status" && grep -q "missing.gguf" <<<"$status" &&
    pass "systemctl status says why" || fail "systemctl status does not say why"
rm -f "$MACHINE/etc/systemd/system/$UNIT.d/broken.conf"
ct systemctl daemon-reload

# --- 7. systemd-analyze security --------------------------------------------------------------------------
say ""; say "== 7. systemd-analyze security $UNIT"
ct systemd-analyze security "$UNIT" --no-pager 2>&1 | grep -E "^✗|Overall exposure" | sed 's/^/  /'

say ""
if [ "$FAILED" = 0 ]; then say "test-systemd: all checks passed"; else say "test-systemd: $FAILED check(s) FAILED"; fi
exit $(( FAILED > 0 ))
