#!/usr/bin/env bash
# A cluster of N hosts on one machine, made of Linux network namespaces (needs root and iproute2).
#
#   tools/cluster.sh up N [--rate RATE] [--prefix P]   make hosts P-h1..P-hN, print P (default prefix: random)
#   tools/cluster.sh down --prefix P                   kill every process on the hosts, delete them
#   tools/cluster.sh with N [--rate RATE] -- CMD ...   up, run CMD with CLUSTER_PREFIX set, always down
#   tools/cluster.sh exec --prefix P I -- CMD ...      run CMD on host I (exec: the pid is CMD's)
#   tools/cluster.sh cut|restore --prefix P I          unplug / plug back host I's cable (switch port down/up)
#   tools/cluster.sh shape --prefix P I RATE|none      limit host I's link both ways (tc tbf), or lift the limit
#   tools/cluster.sh pids --prefix P [I]               pids of the processes on host I (or on every host)
#   tools/cluster.sh list                              prefixes of the clusters that exist now
#
# Host I is the namespace P-hI: `lo` and `eth0` up, address 10.77.0.I/24, hostname hostI (its own UTS namespace,
# under `exec`), and an /etc/hosts that maps hostI to 127.0.1.1 the way Debian and Ubuntu do (the trap gloo falls
# into when it advertises what the hostname resolves to) and the other hosts' names to their addresses. The hosts'
# cables end in a bridge that lives in its own namespace P-sw (the switch), so that no address of the cluster exists
# outside it: the root namespace and other clusters cannot reach it, and two clusters may use the same addresses at
# once. RATE is tc's (1gbit, 100mbit).
# This kernel has tbf and htb but not netem: rates can be shaped, latency and loss cannot.
set -euo pipefail
SUBNET=10.77.0

die() { echo "cluster.sh: $*" >&2; exit 2; }
need_root() {
  command -v ip >/dev/null || die "no \`ip\` command: install iproute2 (apt-get install iproute2)"
  [ "$(id -u)" = 0 ] || die "network namespaces need root (running as uid $(id -u))"
}
hosts_of() { ip netns list | awk '{print $1}' | grep -E "^$1-h[0-9]+$" | sort -V || true; }
host() { echo "$1-h$2"; }

shape() {  # shape P I RATE|none: tbf on both ends of host I's cable (egress of eth0 and of the switch port)
  local p=$1 i=$2 rate=$3 ns dev
  for ns_dev in "$(host "$p" "$i"):eth0" "$p-sw:p$i"; do
    ns=${ns_dev%%:*}; dev=${ns_dev#*:}
    ip -n "$ns" link set "$dev" gso_max_size 65536 2>/dev/null || true
    if [ "$rate" = none ]; then
      tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true
    else  # burst: 4 ms at RATE, at least 128 KiB so that one 64 KiB GSO packet always fits
      local bps; bps=$(rate_bps "$rate")
      local burst=$(( bps / 8 / 250 )); [ "$burst" -ge 131072 ] || burst=131072
      tc -n "$ns" qdisc replace dev "$dev" root tbf rate "$rate" burst "$burst" latency 400ms
    fi
  done
}
rate_bps() {  # tc rate (100mbit, 1gbit, 500kbit, 2500000bit) -> bits per second
  local r=${1,,} n
  n=${r%%[a-z]*}
  case "${r#"$n"}" in
    gbit) echo $(( n * 1000000000 )) ;; mbit) echo $(( n * 1000000 )) ;; kbit) echo $(( n * 1000 )) ;;
    bit|"") echo "$n" ;; *) die "rate '$1': use e.g. 1gbit, 100mbit, 500kbit" ;;
  esac
}

up() {
  local n=$1 rate=$2 p=$3 i h
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 250 ] || die "up N: N between 1 and 250, not '$n'"
  [ -z "$(ip netns list | awk '{print $1}' | grep -E "^$p-(sw|h[0-9]+)$" || true)" ] || die "cluster $p exists"
  trap 'down "$p" >/dev/null 2>&1' ERR  # a half-made cluster is taken down again
  ip netns add "$p-sw"
  ip -n "$p-sw" link add br0 type bridge
  ip -n "$p-sw" link set br0 up
  ip -n "$p-sw" link set lo up
  for i in $(seq 1 "$n"); do
    h=$(host "$p" "$i")
    ip netns add "$h"
    ip -n "$p-sw" link add "p$i" type veth peer name eth0 netns "$h"
    ip -n "$p-sw" link set "p$i" master br0 up
    ip -n "$h" addr add "$SUBNET.$i/24" dev eth0
    ip -n "$h" link set lo up
    ip -n "$h" link set eth0 up
    [ -z "$rate" ] || shape "$p" "$i" "$rate"
  done
  for i in $(seq 1 "$n"); do  # each host: its own name on 127.0.1.1 (Debian), the others at their addresses (DNS),
    # its own address named too (reverse lookups of c10d's store succeed)
    h=$(host "$p" "$i"); mkdir -p "/etc/netns/$h"
    { grep -v '127.0.1.1' /etc/hosts || true; echo "127.0.1.1 host$i"; echo "$SUBNET.$i host$i.cluster"
      for j in $(seq 1 "$n"); do [ "$j" = "$i" ] || echo "$SUBNET.$j host$j"; done; } > "/etc/netns/$h/hosts"
  done
  trap - ERR
  echo "$p"
}

down() {
  local p=$1 ns pids
  for ns in $(hosts_of "$p") "$p-sw"; do
    ip netns list | awk '{print $1}' | grep -qx "$ns" || continue
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -z "$pids" ] || kill -TERM $pids 2>/dev/null || true
  done
  for _ in $(seq 1 20); do  # up to 2 s for them to end, then SIGKILL
    [ -n "$(for ns in $(hosts_of "$p"); do ip netns pids "$ns" 2>/dev/null; done)" ] || break
    sleep 0.1
  done
  for ns in $(hosts_of "$p") "$p-sw"; do
    ip netns list | awk '{print $1}' | grep -qx "$ns" || continue
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
    ip netns del "$ns"
    rm -rf "/etc/netns/$ns"
  done
}

cmd=${1:-}; shift || true
n=""; rate=""; prefix="${CLUSTER_PREFIX:-}"; rest=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rate) rate=$2; shift 2 ;;
    --rate=*) rate=${1#*=}; shift ;;
    --prefix) prefix=$2; shift 2 ;;
    --prefix=*) prefix=${1#*=}; shift ;;
    --) shift; rest+=("$@"); break ;;
    *) rest+=("$1"); shift ;;
  esac
done
[ -z "$prefix" ] || [[ "$prefix" =~ ^[a-zA-Z0-9_]{1,20}$ ]] || die "--prefix: letters, digits, _ (at most 20)"
[ -z "$rate" ] || rate_bps "$rate" >/dev/null
need_prefix() { [ -n "$prefix" ] || die "$cmd: which cluster? give --prefix P (tools/cluster.sh list)"; }
host_arg() {
  [[ "${1:-}" =~ ^[0-9]+$ ]] || die "$cmd: host number expected, got '${1:-}'"
  ip netns list | awk '{print $1}' | grep -qx "$(host "$prefix" "$1")" || die "no host $1 in cluster $prefix"
}

case "$cmd" in
  up)   need_root; [ -n "$prefix" ] || prefix="dc$(printf '%04x' $((RANDOM ^ $$ & 0xffff)))"
        up "${rest[0]:-}" "$rate" "$prefix" ;;
  down) need_root; need_prefix; down "$prefix" ;;
  with) need_root; [ -n "$prefix" ] || prefix="dc$(printf '%04x' $((RANDOM ^ $$ & 0xffff)))"
        [ ${#rest[@]} -ge 2 ] || die "with N -- CMD ..."
        trap 'down "$prefix"' EXIT
        trap 'exit 130' INT TERM
        up "${rest[0]}" "$rate" "$prefix" >/dev/null
        CLUSTER_PREFIX=$prefix "${rest[@]:1}" ;;
  exec) need_root; need_prefix; host_arg "${rest[0]:-}"; [ ${#rest[@]} -ge 2 ] || die "exec I -- CMD ..."
        h=$(host "$prefix" "${rest[0]}")
        exec ip netns exec "$h" unshare --uts -- sh -c 'hostname "$0" && exec "$@"' "host${rest[0]}" "${rest[@]:1}" ;;
  cut|restore) need_root; need_prefix; host_arg "${rest[0]:-}"
        ip -n "$prefix-sw" link set "p${rest[0]}" "$([ "$cmd" = cut ] && echo down || echo up)" ;;
  shape) need_root; need_prefix; host_arg "${rest[0]:-}"; [ -n "${rest[1]:-}" ] || die "shape I RATE|none"
        [ "${rest[1]}" = none ] || rate_bps "${rest[1]}" >/dev/null
        shape "$prefix" "${rest[0]}" "${rest[1]}" ;;
  pids) need_root; need_prefix
        if [ -n "${rest[0]:-}" ]; then host_arg "${rest[0]}"; ip netns pids "$(host "$prefix" "${rest[0]}")"
        else for ns in $(hosts_of "$prefix"); do ip netns pids "$ns"; done; fi ;;
  list) ip netns list 2>/dev/null | awk '{print $1}' | sed -n 's/-sw$//p' ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac
