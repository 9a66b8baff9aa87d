#!/bin/sh
# Test hosts on one machine: network namespaces joined by a bridge, each running its own sshd.
#   hosts.sh up DIR N     creates N hosts; writes DIR/hostfile, DIR/key (root's login key) and
#                         DIR/env (BRIDGE, NETS, the host addresses)
#   hosts.sh down DIR     removes them (sshd processes, namespaces, bridge)
# Addresses are private ones made here (10.213.X.0/24); nothing leaves the machine.
set -eu
cmd=$1
dir=$2
tag=$(basename "$dir" | tr -cd 'a-z0-9' | tail -c 6)
bridge="kvbr$tag"
case "$cmd" in
up)
  n=$3
  net=$(( $$ % 200 + 20 ))
  mkdir -p "$dir" /run/sshd
  ssh-keygen -q -t ed25519 -N '' -f "$dir/key"
  ssh-keygen -q -t ed25519 -N '' -f "$dir/hostkey"
  cp "$dir/key.pub" "$dir/authorized_keys"
  ip link add "$bridge" type bridge
  ip addr add "10.213.$net.1/24" dev "$bridge"
  ip link set "$bridge" up
  : > "$dir/hostfile"
  i=1
  while [ "$i" -le "$n" ]; do
    ns="kvh$tag$i"
    addr="10.213.$net.$((10 + i))"
    ip netns add "$ns"
    ip link add "kvv$tag$i" type veth peer name eth0 netns "$ns"
    ip link set "kvv$tag$i" master "$bridge" up
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    ip -n "$ns" route add default via "10.213.$net.1"
    cat > "$dir/sshd$i.conf" <<CONF
ListenAddress $addr
HostKey $dir/hostkey
AuthorizedKeysFile $dir/authorized_keys
PermitRootLogin yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile $dir/sshd$i.pid
CONF
    ip netns exec "$ns" /usr/sbin/sshd -f "$dir/sshd$i.conf"
    echo "$addr slots=2" >> "$dir/hostfile"
    echo "$ns" >> "$dir/namespaces"
    i=$((i + 1))
  done
  echo "10.213.$net" > "$dir/net"
  ;;
down)
  for pidf in "$dir"/sshd*.pid; do
    [ -f "$pidf" ] && kill "$(cat "$pidf")" 2>/dev/null || true
  done
  if [ -f "$dir/namespaces" ]; then
    while read -r ns; do
      for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
      ip netns del "$ns" 2>/dev/null || true
    done < "$dir/namespaces"
  fi
  ip link del "$bridge" 2>/dev/null || true
  ;;
esac
