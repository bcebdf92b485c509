#!/usr/bin/env bash
# The secrets of the compose cluster (deploy/compose.yaml) in one directory, made once:
#   DIR/coordinator, workers, services, operators   CURVE key set (`asteroid keys init`):
#       workers worker-1..worker-N, services planner and profiler, operator `operator`
#   DIR/redis/ROLE.password                          a random password per Redis ACL user
#       (the roles of deploy/redis-acl.conf: coordinator, worker, planner, ...)
# Running it again keeps every existing key and password and adds what is missing.
# Usage: deploy/images/compose-keys.sh DIR [N_WORKERS (default 3)]
# Environment: ASTEROID (the asteroid command; default on PATH, else .venv/bin/asteroid).
set -euo pipefail
DIR="${1:?usage: compose-keys.sh DIR [N_WORKERS]}"
WORKERS="${2:-3}"
case "$WORKERS" in
    ''|*[!0-9]*) echo "error: N_WORKERS must be a whole number, not '$WORKERS'" >&2; exit 2 ;;
esac
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
ASTEROID="${ASTEROID:-$(command -v asteroid || echo "$ROOT/.venv/bin/asteroid")}"

args=(--service planner --service profiler --operator operator)
for i in $(seq 1 "$WORKERS"); do args+=(--worker "worker-$i"); done
"$ASTEROID" keys init "$DIR" "${args[@]}" >/dev/null

# one password per role the ACL file names, 48 hex digits (URL-safe), owner-only
mkdir -p "$DIR/redis"
chmod 700 "$DIR/redis"
roles="$(grep -o 'SHA256_OF_[A-Z]*_PASSWORD' "$ROOT/deploy/redis-acl.conf" | sed 's/SHA256_OF_//; s/_PASSWORD//' | tr 'A-Z' 'a-z' | sort -u)"
for role in $roles; do
    file="$DIR/redis/$role.password"
    if [ ! -s "$file" ]; then
        (umask 077 && od -An -tx1 -N24 /dev/urandom | tr -d ' \n' > "$file")
    fi
done
echo "compose secrets in $DIR: $WORKERS workers, Redis users $(echo $roles | tr ' ' ,)"
