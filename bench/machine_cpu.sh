#!/usr/bin/env bash
# The whole machine's CPU over a command, from /proc/stat: the seconds the cores were busy
# (user, nice, system, irq, softirq) and idle while it ran. Unlike `time`, it counts what
# the command's processes do not reap: a daemonized PostgreSQL, a browser, the kernel.
#   bench/machine_cpu.sh scripts/test -q
set -uo pipefail
read -r _ u n s i w q sq _ < /proc/stat
"$@"
status=$?
read -r _ u2 n2 s2 i2 w2 q2 sq2 _ < /proc/stat
hz=$(getconf CLK_TCK)
echo "machine: busy $(( (u2 + n2 + s2 + q2 + sq2 - u - n - s - q - sq) / hz )) s," \
     "idle $(( (i2 - i) / hz )) s, iowait $(( (w2 - w) / hz )) s" >&2
exit $status
