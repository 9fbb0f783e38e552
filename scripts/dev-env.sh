# Development defaults for the CONVEYOR_* variables; sourced by scripts/up and scripts/test.
# These secrets are for a local machine only: production sets its own through the environment.
: "${PGPORT:=5432}"
: "${REDIS_PORT:=6379}"
export CONVEYOR_DATABASE_URL="${CONVEYOR_DATABASE_URL:-postgres://conveyor_app:conveyor_app@127.0.0.1:$PGPORT/conveyor}"
export CONVEYOR_MIGRATION_DATABASE_URL="${CONVEYOR_MIGRATION_DATABASE_URL:-postgres://conveyor_owner:conveyor_owner@127.0.0.1:$PGPORT/conveyor}"
export CONVEYOR_RUNTIME_DATABASE_URL="${CONVEYOR_RUNTIME_DATABASE_URL:-postgres://conveyor_runtime:conveyor_runtime@127.0.0.1:$PGPORT/conveyor}"
export CONVEYOR_OPERATOR_DATABASE_URL="${CONVEYOR_OPERATOR_DATABASE_URL:-postgres://conveyor_operator:conveyor_operator@127.0.0.1:$PGPORT/conveyor}"
export CONVEYOR_ADMIN_TOKEN="${CONVEYOR_ADMIN_TOKEN:-dev-only-admin-token-0123456789abcdef0123}"
export CONVEYOR_REDIS_URL="${CONVEYOR_REDIS_URL:-redis://127.0.0.1:$REDIS_PORT}"
export CONVEYOR_JWT_SECRET="${CONVEYOR_JWT_SECRET:-dev-only-jwt-secret-0123456789abcdef0123}"
export CONVEYOR_IDEMPOTENCY_KEYS="${CONVEYOR_IDEMPOTENCY_KEYS:-dev1:dev-only-fingerprint-key-0123456789abcdef}"
export CONVEYOR_ENCRYPTION_KEY="${CONVEYOR_ENCRYPTION_KEY:-ZGV2LW9ubHktZW5jcnlwdGlvbi1rZXktMzItYnl0ZXM=}"
