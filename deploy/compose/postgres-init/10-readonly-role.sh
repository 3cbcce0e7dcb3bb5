#!/bin/sh
# Runs once, when the PostgreSQL volume is initialised: a read-only role for Grafana's
# training panels, with SELECT on every table the migrations create later.
set -eu
if [ -z "${POSTGRES_READONLY_PASSWORD:-}" ]; then
  echo "POSTGRES_READONLY_PASSWORD is empty: no read-only role for Grafana" >&2
  exit 0
fi
psql -v ON_ERROR_STOP=1 -v pw="$POSTGRES_READONLY_PASSWORD" --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" <<'SQL'
CREATE ROLE nextstate_ro LOGIN PASSWORD :'pw';
GRANT CONNECT ON DATABASE nextstate TO nextstate_ro;
GRANT USAGE ON SCHEMA public TO nextstate_ro;
ALTER DEFAULT PRIVILEGES FOR ROLE nextstate IN SCHEMA public GRANT SELECT ON TABLES TO nextstate_ro;
SQL
