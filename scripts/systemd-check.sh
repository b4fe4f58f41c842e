#!/usr/bin/env bash
# Runs systemd/tandemd.service under a real systemd (PID 1 of new pid,
# mount, uts, ipc and network namespaces made with unshare, over this
# host's root file system, whose /etc, /tmp, /var/tmp, /var/lib, /var/cache,
# /var/log/journal, /srv, /usr/local/bin and /run it shadows with private
# copies, and with the early-boot units that would touch the host's kernel,
# devices or files masked: the host is not changed) and checks, with a
# CPU stage on a tiny model and a leader outside the unit in the same
# network namespace:
#   - Type=notify readiness: systemctl start returns once the daemon says
#     READY=1 (it serves);
#   - Restart=on-failure: SIGKILL, and the restarted stage is back in the
#     leader's pipeline;
#   - the watchdog: a stopped (hung) daemon is killed and restarted;
#   - systemd-analyze security's exposure score of the unit.
# Needs root, unshare and nsenter (util-linux), systemd as /lib/systemd/systemd.
#
#   bash scripts/systemd-check.sh BIN_DIR    # BIN_DIR: tandemd and tandemctl
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bin=$(cd "$1" && pwd)
work=$(mktemp -d /var/tmp/tandem-systemd.XXXXXX)
chmod 755 "$work"
sd=""
cleanup() {
  if [ -n "$sd" ]; then kill -9 "$sd" 2>/dev/null || true; fi
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# PID 1 of the namespaces: private mounts, then systemd.
cat >"$work/init.sh" <<INIT
#!/bin/bash
set -e
mount --make-rprivate /
mount -t tmpfs tmpfs /run
mkdir /run/check
mount --bind "$work" /run/check
umount -l /sys/fs/cgroup 2>/dev/null || true
mount -t cgroup2 cgroup2 /sys/fs/cgroup
cp -a /etc "$work/etc"
mount --bind "$work/etc" /etc
mount -t tmpfs tmpfs /srv
mount -t tmpfs tmpfs /usr/local/bin
# A service's default dependencies pull sysinit.target in: its
# systemd-tmpfiles-setup empties /tmp, so /tmp and /var/tmp are private.
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /var/tmp
mount -t tmpfs tmpfs /var/log/journal 2>/dev/null || true
mount -t tmpfs tmpfs /var/lib
mount -t tmpfs tmpfs /var/cache
ip link set lo up
mkdir -p /run/systemd/system
# Early-boot units that act on the host's kernel, devices or clock.
for u in systemd-udevd.service systemd-udev-trigger.service systemd-udev-settle.service \
    systemd-modules-load.service systemd-sysctl.service systemd-tmpfiles-setup-dev.service \
    systemd-binfmt.service proc-sys-fs-binfmt_misc.automount systemd-random-seed.service \
    systemd-hwdb-update.service systemd-machine-id-commit.service systemd-firstboot.service \
    systemd-pstore.service systemd-boot-system-token.service systemd-timesyncd.service \
    sys-kernel-config.mount sys-kernel-debug.mount sys-kernel-tracing.mount sys-fs-fuse-connections.mount \
    dev-hugepages.mount dev-mqueue.mount kmod-static-nodes.service keyboard-setup.service \
    systemd-update-utmp.service ldconfig.service apparmor.service; do
  ln -sf /dev/null /run/systemd/system/\$u
done
cat >/run/systemd/system/check.target <<T
[Unit]
Description=tandem systemd check
T
export container=other
exec /lib/systemd/systemd --system --unit=check.target
INIT
chmod +x "$work/init.sh"
mkdir "$work/bin"
cp "$bin/tandemd" "$bin/tandemctl" "$work/bin/"
unshare --pid --fork --mount --uts --ipc --net "$work/init.sh" </dev/null >"$work/init.log" 2>&1 &
unsharepid=$!
for _ in $(seq 100); do
  sd=$(pgrep -P "$unsharepid" -x systemd || true)
  [ -n "$sd" ] && break
  sleep 0.1
done
[ -n "$sd" ] || { echo "systemd did not start"; cat "$work/init.log"; exit 1; }
ns() { nsenter -t "$sd" -m -p -u -i -n "$@"; }
for _ in $(seq 100); do
  state=$(ns systemctl is-system-running 2>/dev/null || true)
  case $state in running|degraded) break ;; esac
  sleep 0.1
done
echo "systemd $(ns systemctl --version | head -1 | cut -d' ' -f2) is PID 1 of the namespaces: $state"

# The install steps of systemd/README.md, inside.
ns cp /run/check/bin/tandemd /run/check/bin/tandemctl /usr/local/bin/
ns systemd-sysusers "$repo/systemd/tandem.sysusers"
ns id tandem
ns /usr/local/bin/tandemctl model init --out /srv/model --vocab 512 >/dev/null
ns chmod -R a+rX /srv/model
ns install -d -m 0750 -g tandem /etc/tandem
ns sh -c 'cat >/etc/tandem/tandemd.toml' <<TOML
name = "stage-1"
model = "/srv/model"
[listen]
grpc = "127.0.0.1:7410"
gossip = "127.0.0.1:7411"
metrics = "127.0.0.1:9410"
[cluster]
seeds = ["127.0.0.1:7401"]
leader = "leader"
fast_failure_detection = true
[stage]
backend = "cpu"
memory = "1GiB"
TOML
ns chmod 0640 /etc/tandem/tandemd.toml
ns chgrp tandem /etc/tandem/tandemd.toml
ns cp "$repo/systemd/tandemd.service" /run/systemd/system/tandemd.service
ns systemctl daemon-reload
ns systemctl start systemd-journald.service

# The leader, outside the unit, in the same network namespace.
ns sh -c "/usr/local/bin/tandemd serve --name leader --model /srv/model --stage=false --expect-stages 1 \
  --grpc 127.0.0.1:7400 --gossip 127.0.0.1:7401 --leader leader --fast-gossip --log-level warn >/dev/null 2>&1 &"
ctl() { ns /usr/local/bin/tandemctl --addr 127.0.0.1:7400 "$@"; }
show() { ns systemctl show tandemd -p "$1" --value; }
serving() {
  for _ in $(seq 600); do
    if ctl status 2>/dev/null | grep -q '^pipeline: *serving'; then return 0; fi
    sleep 0.1
  done
  return 1
}

echo "== Type=notify readiness"
t0=$(date +%s.%N)
ns systemctl start tandemd
t1=$(date +%s.%N)
echo "systemctl start returned after $(awk "BEGIN {printf \"%.2f\", $t1 - $t0}") s: $(show ActiveState)/$(show SubState), status text: $(show StatusText)"
serving && echo "leader: $(ctl status | grep '^pipeline:')"
ctl generate --max-tokens 4 "Hello" >/dev/null && echo "generate through the pipeline: ok"

echo "== Restart=on-failure after SIGKILL"
pid=$(show MainPID)
ns kill -9 "$pid"
for _ in $(seq 300); do
  [ "$(show NRestarts)" = 1 ] && [ "$(show ActiveState)" = active ] && [ "$(show MainPID)" != "$pid" ] && break
  sleep 0.1
done
echo "after SIGKILL of $pid: NRestarts=$(show NRestarts), $(show ActiveState)/$(show SubState), MainPID=$(show MainPID)"
serving && echo "leader again: $(ctl status | grep '^pipeline:')"
ctl generate --max-tokens 4 "Hello" >/dev/null && echo "generate through the rebuilt pipeline: ok"

echo "== watchdog (WatchdogSec=$(show WatchdogUSec))"
pid=$(show MainPID)
ns kill -STOP "$pid"
t0=$(date +%s)
for _ in $(seq 900); do
  [ "$(show NRestarts)" = 2 ] && [ "$(show ActiveState)" = active ] && break
  sleep 0.1
done
echo "after SIGSTOP of $pid: restarted after $(( $(date +%s) - t0 )) s, NRestarts=$(show NRestarts), $(show ActiveState)/$(show SubState), MainPID=$(show MainPID)"
ns journalctl -u tandemd --no-pager -o cat | grep -iE 'watchdog|killed|Scheduled restart' | sed 's/^/  journal: /'
serving && echo "leader again: $(ctl status | grep '^pipeline:')"

echo "== systemd-analyze security"
ns systemd-analyze security tandemd.service --no-pager | tail -1
ns systemctl stop tandemd
echo "after systemctl stop: $(show ActiveState), result $(show Result), exit status $(show ExecMainStatus)"
