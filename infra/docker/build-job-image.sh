#!/usr/bin/env bash
# Build the job image (repo-root Dockerfile) with the classic builder and --network host.
# Usage: build-job-image.sh [--no-torch] [--tag IMAGE] [--base IMAGE] [-- extra docker build args]
#   Stages a small build context under $OPENLAB_INFRA_STATE/job-context (pyproject, orchestrator/,
#   workloads/, flows/, extra CA certs), so nothing is written into the repo.
#   A CPU torch wheel (TORCH_WHEEL, default /opt/wheels/torch-*cp311*.whl) is served to the build from a
#   loopback HTTP server (TORCH_WHEEL_MODE=http, default: the wheel never becomes an image layer) or copied
#   into the context (TORCH_WHEEL_MODE=copy). Without a wheel, set TORCH_INDEX_URL (a CPU index) or use --no-torch.
# Env: JOB_IMAGE (openlab/job:latest), BASE_IMAGE (openlab/python-base:bookworm), EXTRA_CA_CERTS_DIR
#      (/usr/local/share/ca-certificates), TORCH_WHEEL, TORCH_WHEEL_MODE, OPENLAB_WHEEL_PORT (38765),
#      TORCH_INDEX_URL, PIP_INDEX, PIP_EXTRA_INDEX.
set -euo pipefail
LOG_TAG=job-image
source "$(dirname "$0")/../lib.sh"
need_root

IMAGE="${JOB_IMAGE:-openlab/job:latest}"
BASE="${BASE_IMAGE:-openlab/python-base:bookworm}"
WITH_TORCH=1
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-torch) WITH_TORCH=0 ;;
    --tag) IMAGE="$2"; shift ;;
    --base) BASE="$2"; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown argument: $1 (see the header of $0)" ;;
  esac
  shift
done

docker info >/dev/null 2>&1 || die "docker is not running (run infra/docker/start.sh)"
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  if [ "$BASE" = "openlab/python-base:bookworm" ]; then
    "$INFRA_DIR/docker/build-base-image.sh"
  else
    log "base image $BASE is not local; docker will try to pull it"
  fi
fi

# --- stage the build context ------------------------------------------------------------
CTX="$OPENLAB_INFRA_STATE/job-context"
log "staging build context in $CTX"
rm -rf "$CTX"
mkdir -p "$CTX/infra/docker/wheels" "$CTX/infra/docker/certs"
cp "$REPO_ROOT/Dockerfile" "$REPO_ROOT/.dockerignore" "$REPO_ROOT/pyproject.toml" "$CTX/"
[ -f "$REPO_ROOT/README.md" ] && cp "$REPO_ROOT/README.md" "$CTX/"
for d in orchestrator workloads flows; do
  if [ -d "$REPO_ROOT/$d" ]; then
    cp -a "$REPO_ROOT/$d" "$CTX/$d"
  else
    log "WARNING: $d/ does not exist in the repo; the image gets an empty $d package"
    mkdir -p "$CTX/$d"; : >"$CTX/$d/__init__.py"
  fi
done
find "$CTX" \( -name __pycache__ -o -name '*.egg-info' -o -name .pytest_cache \) -prune -exec rm -rf {} +
CA_DIR="${EXTRA_CA_CERTS_DIR:-/usr/local/share/ca-certificates}"
if ls "$CA_DIR"/*.crt >/dev/null 2>&1; then
  cp "$CA_DIR"/*.crt "$CTX/infra/docker/certs/"
  log "extra CA certificates: $(cd "$CA_DIR" && ls ./*.crt | xargs -n1 basename | tr '\n' ' ')"
fi

# --- which code the image holds -------------------------------------------------------------
# The label openlab.io/code maps each copied path (relative to the git top level) to its git id in
# the working tree, uncommitted edits included: computed like orchestrator.provenance.git.path_hashes,
# with a throwaway index and object directory so nothing is written into the repository. Pipeline
# stages that run the image's code (Kubernetes; Docker with mount_workdir = false) compare it with
# the run's tree and refuse a mismatch (orchestrator/provenance/image.py).
code_label() {
  local top prefix common tmp tree
  top="$(git -C "$REPO_ROOT" rev-parse --show-toplevel 2>/dev/null)" || return 1
  prefix="$(git -C "$REPO_ROOT" rev-parse --show-prefix)"
  common="$(git -C "$top" rev-parse --path-format=absolute --git-common-dir)"
  tmp="$(mktemp -d)"
  mkdir "$tmp/objects"
  [ -f "$(git -C "$top" rev-parse --path-format=absolute --git-dir)/index" ] \
    && cp -p "$(git -C "$top" rev-parse --path-format=absolute --git-dir)/index" "$tmp/index"
  tree="$(cd "$top" && GIT_INDEX_FILE="$tmp/index" GIT_OBJECT_DIRECTORY="$tmp/objects" \
    GIT_ALTERNATE_OBJECT_DIRECTORIES="$common/objects" sh -c 'git add -A -- . && git write-tree')" \
    || { rm -rf "$tmp"; return 1; }
  local pairs=() p id
  for p in orchestrator workloads flows pyproject.toml; do
    id="$(cd "$top" && GIT_INDEX_FILE="$tmp/index" GIT_OBJECT_DIRECTORY="$tmp/objects" \
      GIT_ALTERNATE_OBJECT_DIRECTORIES="$common/objects" git rev-parse --verify --quiet "$tree:$prefix$p")" || continue
    pairs+=("$prefix$p=$id")
  done
  rm -rf "$tmp"
  python3 -c 'import json, sys; print(json.dumps(dict(a.split("=", 1) for a in sys.argv[1:]), sort_keys=True, separators=(",", ":")))' "${pairs[@]}"
}

ARGS=(--build-arg "BASE=$BASE" --build-arg "WITH_TORCH=$WITH_TORCH")
if CODE="$(code_label)"; then
  ARGS+=(--label "openlab.io/code=$CODE")
  log "code label: $CODE"
else
  log "WARNING: $REPO_ROOT is not a git working tree: the image gets no openlab.io/code label, and pipeline stages that run its code will refuse it unless image_code_check = \"warn\" or \"off\""
fi
[ -n "${TORCH_INDEX_URL:-}" ] && ARGS+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
[ -n "${PIP_INDEX:-}" ] && ARGS+=(--build-arg "PIP_INDEX=$PIP_INDEX")
[ -n "${PIP_EXTRA_INDEX:-}" ] && ARGS+=(--build-arg "PIP_EXTRA_INDEX=$PIP_EXTRA_INDEX")

# --- torch wheel --------------------------------------------------------------------------
HTTP_PID=""
cleanup() { [ -n "$HTTP_PID" ] && kill "$HTTP_PID" 2>/dev/null || true; }
trap cleanup EXIT
if [ "$WITH_TORCH" = 1 ]; then
  WHEEL="${TORCH_WHEEL:-$(ls /opt/wheels/torch-*-cp311-*.whl 2>/dev/null | sort -V | tail -n 1 || true)}"
  if [ -n "$WHEEL" ]; then
    [ -f "$WHEEL" ] || die "TORCH_WHEEL=$WHEEL does not exist"
    case "${TORCH_WHEEL_MODE:-http}" in
      copy)
        cp "$WHEEL" "$CTX/infra/docker/wheels/"
        log "torch wheel copied into the context: $(basename "$WHEEL")" ;;
      http)
        # a fixed port keeps the build arg (and so the layer cache) stable between builds
        PORT="${OPENLAB_WHEEL_PORT:-38765}"
        if ! python3 -c "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', $PORT))" 2>/dev/null; then
          log "port $PORT is busy; using a random port (the torch layer will be rebuilt)"
          PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
        fi
        python3 -m http.server --bind 127.0.0.1 --directory "$(dirname "$WHEEL")" "$PORT" >/dev/null 2>&1 &
        HTTP_PID=$!
        wait_for 10 "wheel server on 127.0.0.1:$PORT" python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/')" \
          || die "could not serve $WHEEL over loopback HTTP"
        # the wheel file name carries the local version (+cpu); URL-encode the '+'
        ARGS+=(--build-arg "TORCH_SPEC=http://127.0.0.1:$PORT/$(basename "$WHEEL" | sed 's/+/%2B/g')")
        log "torch wheel served from http://127.0.0.1:$PORT/ : $(basename "$WHEEL")" ;;
      *) die "TORCH_WHEEL_MODE must be http or copy" ;;
    esac
  elif [ -z "${TORCH_INDEX_URL:-}" ]; then
    die "no CPU torch wheel found (set TORCH_WHEEL=/path/torch-...+cpu-cp311-...whl, or TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu, or pass --no-torch)"
  fi
fi

# --- build ----------------------------------------------------------------------------------
OLD_ID="$(docker image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
log "building $IMAGE (base $BASE, torch=$WITH_TORCH)"
start=$SECONDS
DOCKER_BUILDKIT=0 run docker build --network host --force-rm "${ARGS[@]}" "${EXTRA[@]}" -t "$IMAGE" "$CTX" \
  || die "docker build of $IMAGE failed"
NEW_ID="$(docker image inspect -f '{{.Id}}' "$IMAGE")"
if [ -n "$OLD_ID" ] && [ "$OLD_ID" != "$NEW_ID" ] && [ -z "$(docker image inspect -f '{{join .RepoTags ","}}' "$OLD_ID" 2>/dev/null)" ]; then
  docker rmi "$OLD_ID" >/dev/null 2>&1 && log "removed the previous, now untagged image ${OLD_ID:7:12}" || true
fi
SIZE="$(docker image inspect -f '{{.Size}}' "$IMAGE" | numfmt --to=iec)"
log "built $IMAGE in $((SECONDS - start))s, size $SIZE"
log "smoke test: $(docker run --rm --network none "$IMAGE" python -c 'import orchestrator, workloads, flows, sys; print("ok python", sys.version.split()[0])')"
