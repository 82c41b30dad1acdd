#!/usr/bin/env bash
# Build the Docker images with podman and run them (a manual check, minutes long: not run by the
# tests or CI). Needs root, like the project's machines; no image registry is reached:
#   - podman, runc, debootstrap and docker-compose (1.29, the Python one: a strict check of the compose
#     schema) are Debian packages (apt-get installs them when missing); podman-compose is a PyPI
#     package (pip installs it into a venv in $DOCKER_CHECK_WORK);
#   - the base images are made here: `debootstrap --variant=minbase bookworm` imported as
#     localhost/debian-base:bookworm (the CUDA image's stand-in for nvidia/cuda), and
#     localhost/python-base:3.11-bookworm on top of it (Debian's python3 + venv, the stand-in for
#     python:3.11-slim). Both carry this machine's CA bundle (PIP_CERT) so that pip inside a build
#     reaches the package index as the host's pip does;
#   - torch is the host's `pip download torch==<the Dockerfile's TORCH_VERSION>` (the CPU wheel on
#     this machine's disk) in docker/wheels/, mounted into the build (--find-links /wheels); the
#     other packages come from the package index.
#
#   bash scripts/docker-check.sh          # the CPU image: build, run, check; validate docker/compose.yaml
#   bash scripts/docker-check.sh --cuda   # also the CUDA image on the Debian base (PyPI's CUDA torch,
#                                         # several GB): torch imports, and the same checks on the CPU
#
# Checks, through the port published on 127.0.0.1: the image's built-in pair with no arguments
# (/health, the image's HEALTHCHECK, /v1/models, a completion, a streamed chat, a JSON-schema chat),
# the server process's non-root uid, a model mounted read-only at /models (served, and not
# writable), and exit status 0 on SIGTERM. Then docker/compose.yaml: `config` (docker-compose 1.29
# and podman-compose; also `docker compose config` where that plugin exists), and `up` of the CPU
# server service, called from another container on the compose network at Open WebUI's URL.
# Layers are cached: a rerun after a code change rebuilds only the layers from `COPY engine` on.
# The base rootfs, containers.conf and the logs go in $DOCKER_CHECK_WORK. Every container it
# starts is removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

WORK=${DOCKER_CHECK_WORK:-/var/tmp/specexec-docker}
PORT=${DOCKER_CHECK_PORT:-18000}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
HOST_CA=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
CUDA=0
for arg in "$@"; do
  case $arg in
    --cuda) CUDA=1 ;;
    *) echo "usage: $0 [--cuda]" >&2; exit 2 ;;
  esac
done

PASSED=0
FAILED=0
ok() { echo "PASS  $*"; PASSED=$((PASSED + 1)); }
fail() { echo "FAIL  $*"; FAILED=$((FAILED + 1)); }
check() {  # description command...: PASS when the command succeeds
  local what=$1; shift
  if "$@"; then ok "$what"; else fail "$what"; fi
}

# --- tools -------------------------------------------------------------------------------------
missing=()
for tool in podman runc debootstrap docker-compose; do command -v "$tool" > /dev/null || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]} (Debian packages)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" > /dev/null 2>&1
fi
mkdir -p "$WORK/empty"
WORK=$(cd "$WORK" && pwd)
# Debian's podman-compose (1.0.3) has no `config`: PyPI's, in a venv of its own.
PODMAN_COMPOSE=$WORK/compose-venv/bin/podman-compose
if [ ! -x "$PODMAN_COMPOSE" ]; then
  python3 -m venv "$WORK/compose-venv"
  "$WORK/compose-venv/bin/pip" install -q podman-compose > "$WORK/pip.log" 2>&1 || { cat "$WORK/pip.log"; exit 1; }
fi
# runc and cgroupfs: crun fails here on hybrid cgroups and on setrlimit; no default ulimits either.
# The [engine] lines are for podman-compose, which runs podman without these flags.
printf '[containers]\ndefault_ulimits = []\npids_limit = 0\n\n[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\n' \
  > "$WORK/containers.conf"
export CONTAINERS_CONF=$WORK/containers.conf
podman() { command podman --runtime runc --cgroup-manager=cgroupfs "$@"; }

CONTAINERS=()
COMPOSE_PROJECT=specexec-docker-check-$$
cleanup() {
  for name in "${CONTAINERS[@]}"; do podman rm -f -t 0 "$name" > /dev/null 2>&1 || true; done
  "$PODMAN_COMPOSE" -p "$COMPOSE_PROJECT" -f docker/compose.yaml down > /dev/null 2>&1 || true
}
trap cleanup EXIT

# --- base images -------------------------------------------------------------------------------
if ! podman image exists localhost/debian-base:bookworm; then
  echo "debootstrap bookworm (minbase) into $WORK/rootfs"
  rm -rf "$WORK/rootfs"
  debootstrap --variant=minbase bookworm "$WORK/rootfs" "$DEBIAN_MIRROR" > "$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log"; exit 1; }
  rm -f "$WORK"/rootfs/var/cache/apt/archives/*.deb
  mkdir -p "$WORK/rootfs/etc/ssl/certs"
  cp "$HOST_CA" "$WORK/rootfs/etc/ssl/certs/host-ca-certificates.crt"
  tar -C "$WORK/rootfs" -c . \
    | podman import --change 'ENV PIP_CERT=/etc/ssl/certs/host-ca-certificates.crt' - localhost/debian-base:bookworm \
      > "$WORK/import.log" 2>&1
fi
if ! podman image exists localhost/python-base:3.11-bookworm; then
  printf '%s\n' 'FROM localhost/debian-base:bookworm' \
    'RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates && rm -rf /var/lib/apt/lists/*' \
    | podman build --network host --format docker -t localhost/python-base:3.11-bookworm -f - "$WORK/empty" \
      > "$WORK/python-base.log" 2>&1 || { tail -20 "$WORK/python-base.log"; exit 1; }
fi

# --- the torch wheel ---------------------------------------------------------------------------
TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' docker/Dockerfile.cpu)
if ! ls docker/wheels/torch-"$TORCH_VERSION"+cpu-*.whl > /dev/null 2>&1; then
  python3 -m pip download -q --no-deps -d docker/wheels "torch==$TORCH_VERSION" > "$WORK/pip.log" 2>&1 \
    || { cat "$WORK/pip.log"; exit 1; }
fi
ls docker/wheels/torch-"$TORCH_VERSION"+cpu-*.whl > /dev/null \
  || { echo "no CPU wheel of torch $TORCH_VERSION in docker/wheels (pip downloaded another build)" >&2; exit 1; }

build() {  # dockerfile tag build-args...
  local dockerfile=$1 tag=$2 log
  shift 2
  log="$WORK/build-${tag##*:}.log"
  echo "podman build -f $dockerfile -t $tag $(printf "%q " "$@"). (log: $log)"
  local start=$SECONDS
  if ! podman build --network host --format docker -f "$dockerfile" -t "$tag" "$@" . > "$log" 2>&1; then
    tail -20 "$log"
    fail "build $tag"
    return 1
  fi
  ok "build $tag ($((SECONDS - start)) s, $(podman image inspect --format '{{.Size}}' "$tag" \
    | awk '{printf "%.2f GB", $1 / 1e9}'))"
}

# --- runtime checks ----------------------------------------------------------------------------
wait_health() {  # name seconds
  local status
  for _ in $(seq "$2"); do
    status=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/health" || true)
    [ "$status" = 200 ] && return 0
    [ "$(podman inspect --format '{{.State.Running}}' "$1")" = true ] || { podman logs "$1" 2>&1 | tail -20; return 1; }
    sleep 1
  done
  podman logs "$1" 2>&1 | tail -20
  return 1
}

post() {  # path json: the response body on stdout
  curl -sS -N --max-time 120 -H 'Content-Type: application/json' -d "$2" "http://127.0.0.1:$PORT$1"
}

completion_ok() {
  post /v1/completions '{"model": "specexec-default", "prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0}' \
    | python3 -c '
import json, sys
body = json.load(sys.stdin)
choice = body["choices"][0]
assert body["object"] == "text_completion" and choice["text"] and body["usage"]["completion_tokens"] > 0, body
print("      completion:", repr(choice["text"]), choice["finish_reason"])'
}

streamed_chat_ok() {
  post /v1/chat/completions '{"model": "specexec-default", "stream": true, "max_tokens": 24, "temperature": 0,
    "stream_options": {"include_usage": true}, "messages": [{"role": "user", "content": "Write a Python loop."}]}' \
    | python3 -c '
import json, sys
events = [line[len("data: "):] for line in sys.stdin.read().splitlines() if line.startswith("data: ")]
assert events[-1] == "[DONE]", events[-3:]
chunks = [json.loads(event) for event in events[:-1]]
assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])
finish = [chunk["choices"][0]["finish_reason"] for chunk in chunks if chunk["choices"]][-1]
tokens = chunks[-1]["usage"]["completion_tokens"]
assert text and finish in ("stop", "length") and tokens > 0, (text, finish, tokens)
print(f"      streamed chat: {len(chunks)} chunks, {tokens} tokens, {finish}: {text!r}")'
}

json_schema_ok() {  # structured output: xgrammar in the image
  post /v1/chat/completions '{"model": "specexec-default", "max_tokens": 64, "temperature": 0,
    "messages": [{"role": "user", "content": "Pick a license."}],
    "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": {"type": "object",
      "properties": {"license": {"enum": ["MIT", "BSD", "GPL"]}}, "required": ["license"], "additionalProperties": false}}}}' \
    | python3 -c '
import json, sys
content = json.load(sys.stdin)["choices"][0]["message"]["content"]
assert json.loads(content)["license"] in ("MIT", "BSD", "GPL"), content
print("      JSON schema:", repr(content))'
}

started_on_mounted_pair() {  # name
  podman exec "$1" cat /proc/1/cmdline | tr '\0' ' ' | grep -q -- '--target /models/target'
}

models_read_only() {  # name: writing as root in the container fails too
  local err
  err=$(podman exec --user 0 "$1" touch /models/probe 2>&1) && return 1
  echo "      touch /models/probe as root: $err"
  [[ $err == *"Read-only file system"* ]]
}

server_uid() { podman exec "$1" sh -c 'awk "/^Uid:/ {print \$2}" /proc/1/status'; }

sigterm_exits_0() {  # name
  podman kill --signal TERM "$1" > /dev/null
  local code
  code=$(timeout 60 podman wait "$1")
  echo "      exit status after SIGTERM: $code"
  [ "$code" = 0 ]
}

check_image() {  # tag
  local tag=$1 name="specexec-docker-check-$$-${1##*:}"
  local user
  user=$(podman image inspect --format '{{.Config.User}}' "$tag")
  check "$tag: image user $user is not root" test "${user%%:*}" != 0 -a -n "$user"

  # 1. No arguments: the built-in pair baked into the image.
  CONTAINERS+=("$name")
  if ! podman run -d --name "$name" -p "127.0.0.1:$PORT:8000" "$tag" > /dev/null 2>> "$WORK/podman.log"; then
    tail -3 "$WORK/podman.log"
    fail "$tag: podman run (port $PORT taken? DOCKER_CHECK_PORT=...)"
    return
  fi
  if ! wait_health "$name" 300; then fail "$tag: /health 200 within 300 s"; return; fi
  ok "$tag: /health 200 through 127.0.0.1:$PORT (built-in pair)"
  check "$tag: the image's HEALTHCHECK passes" podman healthcheck run "$name"
  check "$tag: /v1/models lists specexec-default" \
    sh -c "curl -sf http://127.0.0.1:$PORT/v1/models | grep -q '\"id\":\"specexec-default\"'"
  check "$tag: a completion" completion_ok
  check "$tag: a streamed chat" streamed_chat_ok
  check "$tag: a JSON-schema chat" json_schema_ok
  local uid
  uid=$(server_uid "$name")
  check "$tag: the server (pid 1) runs as uid $uid, not root" test "$uid" != 0
  check "$tag: exit status 0 on SIGTERM" sigterm_exits_0 "$name"
  podman rm -f -t 0 "$name" > /dev/null

  # 2. A pair mounted read-only at /models (the built-in pair's files, from the repo).
  if ! podman run -d --name "$name" -p "127.0.0.1:$PORT:8000" -v "$REPO/models/default:/models:ro" \
      "$tag" --config /app/configs/default.toml --target /models/target --draft /models/draft \
      > /dev/null 2>> "$WORK/podman.log"; then
    tail -3 "$WORK/podman.log"
    fail "$tag: podman run with a mounted pair"
    return
  fi
  if ! wait_health "$name" 300; then fail "$tag: /health 200 with a mounted pair"; return; fi
  check "$tag: serves the pair mounted at /models (a completion)" completion_ok
  check "$tag: the server was started on /models/target" started_on_mounted_pair "$name"
  check "$tag: /models is read-only in the container" models_read_only "$name"
  check "$tag: exit status 0 on SIGTERM (mounted pair)" sigterm_exits_0 "$name"
  podman rm -f -t 0 "$name" > /dev/null
}

# --- the CPU image -----------------------------------------------------------------------------
if build docker/Dockerfile.cpu localhost/specexec-server:cpu \
    --build-arg BASE_IMAGE=localhost/python-base:3.11-bookworm --build-arg TORCH_PIP_ARGS="--find-links /wheels"; then
  check_image localhost/specexec-server:cpu
fi

# --- the CUDA image (on the Debian base; no GPU here: the server falls back to the CPU) ----------
if [ "$CUDA" = 1 ]; then
  if build docker/Dockerfile.cuda localhost/specexec-server:cuda --build-arg BASE_IMAGE=localhost/debian-base:bookworm; then
    torch_line=$(podman run --rm --entrypoint python localhost/specexec-server:cuda -c \
      'import torch; print(torch.__version__, "CUDA", torch.version.cuda, "available:", torch.cuda.is_available())' 2>&1 | tail -1)
    echo "      $torch_line"
    check "cuda image: torch $TORCH_VERSION imports" test "${torch_line%%[+ ]*}" = "$TORCH_VERSION"
    check_image localhost/specexec-server:cuda
  fi
fi

# --- docker/compose.yaml -----------------------------------------------------------------------
if command -v docker > /dev/null && docker compose version > /dev/null 2>&1; then
  check "docker compose config (docker/compose.yaml)" sh -c "docker compose -f docker/compose.yaml config > '$WORK/compose-docker.txt'"
else
  echo "      (no 'docker compose' plugin here)"
fi
dc_version=$(docker-compose version --short 2>/dev/null || true)
check "docker-compose $dc_version config (the compose schema: unknown keys are errors)" \
  sh -c "docker-compose -f docker/compose.yaml config > '$WORK/compose-docker-compose.txt' 2>&1"
check "docker-compose $dc_version config --profile cuda" \
  sh -c "docker-compose -f docker/compose.yaml --profile cuda config > '$WORK/compose-docker-compose-cuda.txt' 2>&1"
compose_version=$("$PODMAN_COMPOSE" version 2>/dev/null | sed -n 's/^podman-compose version //p' | head -1)
check "podman-compose $compose_version config (docker/compose.yaml)" \
  sh -c "'$PODMAN_COMPOSE' -f docker/compose.yaml config > '$WORK/compose-podman.txt' 2>&1"
check "podman-compose $compose_version config --profile cuda" \
  sh -c "'$PODMAN_COMPOSE' -f docker/compose.yaml --profile cuda config > '$WORK/compose-podman-cuda.txt' 2>&1"

# Up for real: the CPU server service as compose starts it (the image built above, the repo's models/
# mounted read-only), reached from another container on the compose network by the name Open WebUI's
# URL uses. Open WebUI's own image is not started: no registry is reachable here.
if podman image exists localhost/specexec-server:cpu; then
  if SPECEXEC_PORT=$PORT "$PODMAN_COMPOSE" -p "$COMPOSE_PROJECT" -f docker/compose.yaml up -d --no-build specexec-cpu \
      > "$WORK/compose-up.log" 2>&1 && wait_health "${COMPOSE_PROJECT}_specexec-cpu_1" 300; then
    ok "podman-compose up specexec-cpu: /health 200 through 127.0.0.1:$PORT"
    check "compose network: http://specexec:8000/v1 answers a chat (as Open WebUI would call it), another name gets 403" \
      podman run --rm --network "${COMPOSE_PROJECT}_default" localhost/python-base:3.11-bookworm python3 -c '
import json, urllib.error, urllib.request
body = json.dumps({"model": "specexec-default", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})
request = urllib.request.Request("http://specexec:8000/v1/chat/completions", body.encode(), {"Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(request, timeout=60))
print("      via http://specexec:8000:", repr(reply["choices"][0]["message"]["content"]))
try:
    urllib.request.urlopen("http://'"${COMPOSE_PROJECT}"'_specexec-cpu_1:8000/v1/models", timeout=10)
    raise SystemExit("the Host check let an unlisted name through")
except urllib.error.HTTPError as error:
    assert error.code == 403, error'
  else
    tail -20 "$WORK/compose-up.log"
    fail "podman-compose up specexec-cpu"
  fi
  "$PODMAN_COMPOSE" -p "$COMPOSE_PROJECT" -f docker/compose.yaml down > "$WORK/compose-down.log" 2>&1 || true
fi

echo "docker-check: $PASSED passed, $FAILED failed"
[ "$FAILED" = 0 ]
