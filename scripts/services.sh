#!/usr/bin/env bash
# Makes sure PostgreSQL and Redis answer on loopback, then creates Conveyor's roles (owner, application, runtime,
# operator) and database.
#
# Reuses servers that already answer on 127.0.0.1:${PGPORT:-5432} and 127.0.0.1:${REDIS_PORT:-6379}; otherwise
# installs them from Debian's packages (as root) and starts them. Safe to run again. Both README commands use it.
set -euo pipefail

PGPORT=${PGPORT:-5432}
REDIS_PORT=${REDIS_PORT:-6379}
OWNER_ROLE=${CONVEYOR_OWNER_ROLE:-conveyor_owner}
APP_ROLE=${CONVEYOR_APP_ROLE:-conveyor_app}
OPERATOR_ROLE=${CONVEYOR_OPERATOR_ROLE:-conveyor_operator}
RUNTIME_ROLE=${CONVEYOR_RUNTIME_ROLE:-conveyor_runtime}
DATABASE=${CONVEYOR_DATABASE:-conveyor}

log() { printf 'services: %s\n' "$*" >&2; }

answers() { # host port
  (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

apt_updated=0
apt_install() {
  if [ "$(id -u)" != 0 ]; then
    log "need root to install: $*"; exit 1
  fi
  if [ "$apt_updated" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    apt_updated=1
  fi
  log "installing $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# --- binaries (tests also start their own redis-server and use psql) ---
command -v redis-server >/dev/null && command -v redis-cli >/dev/null || apt_install redis-server redis-tools
command -v psql >/dev/null && command -v pg_isready >/dev/null || apt_install postgresql-client
if ! answers 127.0.0.1 "$PGPORT" && ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
  apt_install postgresql postgresql-contrib
fi

# --- PostgreSQL ---
if answers 127.0.0.1 "$PGPORT"; then
  log "PostgreSQL answers on 127.0.0.1:$PGPORT; reusing it"
else
  ver=$(ls /usr/lib/postgresql | sort -V | tail -n 1)
  if [ ! -d "/etc/postgresql/$ver/main" ]; then
    pg_createcluster "$ver" main -p "$PGPORT" >/dev/null
  fi
  log "starting PostgreSQL $ver"
  pg_ctlcluster --skip-systemctl-redirect "$ver" main start || pg_ctlcluster "$ver" main start
  for _ in $(seq 1 50); do answers 127.0.0.1 "$PGPORT" && break; sleep 0.2; done
  answers 127.0.0.1 "$PGPORT" || { log "PostgreSQL did not come up on 127.0.0.1:$PGPORT"; exit 1; }
fi

# A superuser session: over loopback where trust allows it, else as the postgres OS user over the socket.
as_superuser() {
  if PGCONNECT_TIMEOUT=3 psql -w -h 127.0.0.1 -p "$PGPORT" -U postgres -d postgres -Atqc 'select 1' >/dev/null 2>&1; then
    psql -w -h 127.0.0.1 -p "$PGPORT" -U postgres -d postgres -v ON_ERROR_STOP=1 -Atq "$@"
  elif [ "$(id -u)" = 0 ] && id postgres >/dev/null 2>&1; then
    (cd / && runuser -u postgres -- psql -p "$PGPORT" -d postgres -v ON_ERROR_STOP=1 -Atq "$@")
  else
    log "cannot open a superuser session on PostgreSQL to create roles"; exit 1
  fi
}

as_superuser <<SQL
DO \$\$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '$OWNER_ROLE') THEN
    CREATE ROLE $OWNER_ROLE LOGIN PASSWORD '$OWNER_ROLE' CREATEDB;
  END IF;
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '$APP_ROLE') THEN
    CREATE ROLE $APP_ROLE LOGIN PASSWORD '$APP_ROLE';
  END IF;
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '$OPERATOR_ROLE') THEN
    CREATE ROLE $OPERATOR_ROLE LOGIN PASSWORD '$OPERATOR_ROLE';
  END IF;
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '$RUNTIME_ROLE') THEN
    CREATE ROLE $RUNTIME_ROLE LOGIN PASSWORD '$RUNTIME_ROLE';
  END IF;
END
\$\$;
ALTER ROLE $OWNER_ROLE LOGIN CREATEDB NOSUPERUSER NOBYPASSRLS;
ALTER ROLE $APP_ROLE LOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE NOINHERIT;
ALTER ROLE $OPERATOR_ROLE LOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE NOINHERIT;
ALTER ROLE $RUNTIME_ROLE LOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE NOINHERIT;
SQL
if [ "$(as_superuser -c "SELECT 1 FROM pg_database WHERE datname = '$DATABASE'")" != 1 ]; then
  as_superuser -c "CREATE DATABASE $DATABASE OWNER $OWNER_ROLE"
  log "created database $DATABASE"
fi

# --- Redis ---
if answers 127.0.0.1 "$REDIS_PORT"; then
  log "Redis answers on 127.0.0.1:$REDIS_PORT; reusing it"
else
  log "starting Redis on 127.0.0.1:$REDIS_PORT"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 --port "$REDIS_PORT" --save "" --appendonly no \
    --maxmemory-policy noeviction --dir /var/lib/redis --logfile /var/log/redis/conveyor.log
  for _ in $(seq 1 50); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.2; done
  redis-cli -p "$REDIS_PORT" ping >/dev/null || { log "Redis did not come up"; exit 1; }
fi
log "ready: PostgreSQL 127.0.0.1:$PGPORT (database $DATABASE, roles $OWNER_ROLE/$APP_ROLE/$RUNTIME_ROLE/$OPERATOR_ROLE), Redis 127.0.0.1:$REDIS_PORT"
