# openlab job image: Python + the project's runtime deps + orchestrator/ workloads/ flows/.
# build-job-image.sh adds --label openlab.io/code={path: git id} of the tree it copies (see orchestrator/provenance/image.py).
#
#   infra/docker/build-job-image.sh            # prepares wheels/certs, builds openlab/job:latest
#   DOCKER_BUILDKIT=0 docker build --network host -t openlab/job:latest .     # by hand
#
# Build args
#   BASE             base image. python:3.11-slim needs a registry; where none is reachable use the locally
#                    built openlab/python-base:bookworm (infra/docker/build-base-image.sh).
#   EXTRA_CA_CERTS   PEM text of extra CA certificates to trust (intercepting / corporate proxies).
#                    Files put in infra/docker/certs/*.crt are trusted too.
#   WITH_TORCH       1 (default): install a CPU-only torch; 0: no torch (much smaller image).
#   TORCH_SPEC       pip requirement or wheel URL for torch, used when infra/docker/wheels/ holds no torch wheel.
#   TORCH_INDEX_URL  a CPU wheel index, e.g. https://download.pytorch.org/whl/cpu. PyPI's default Linux torch is
#                    the CUDA build (several GB), so a CPU source is required: a wheel or an index.
#   PIP_INDEX / PIP_EXTRA_INDEX  optional pip index overrides (mirrors).
# Builds need --network host for pip (the default build network can be loopback-only).
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG EXTRA_CA_CERTS=""
ARG WITH_TORCH=1
ARG TORCH_SPEC=""
ARG TORCH_INDEX_URL=""
ARG PIP_INDEX=""
ARG PIP_EXTRA_INDEX=""

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONUNBUFFERED=1 \
    DO_NOT_TRACK=1 \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
# metadata first: with the classic builder every step (even ENV/WORKDIR) snapshots the whole image,
# which is expensive on vfs storage, so the steps after the big layers are kept to a minimum
WORKDIR /work
CMD ["python"]

# 1. trust extra CA certificates (files from the context and/or the build arg)
COPY infra/docker/certs/ /usr/local/share/ca-certificates/openlab/
RUN set -eu; \
    if [ -n "$EXTRA_CA_CERTS" ]; then printf '%s\n' "$EXTRA_CA_CERTS" > /usr/local/share/ca-certificates/openlab/build-arg.crt; fi; \
    if ! command -v update-ca-certificates >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*; \
    fi; \
    update-ca-certificates 2>/dev/null | tail -n 1; \
    rm -f /usr/lib/python3*/EXTERNALLY-MANAGED

# 2. CPU-only torch (its own layer: it changes rarely and is the bulk of the image)
COPY infra/docker/wheels/ /tmp/wheels/
RUN set -eu; \
    idx=""; [ -n "$PIP_INDEX" ] && idx="--index-url $PIP_INDEX"; \
    [ -n "$PIP_EXTRA_INDEX" ] && idx="$idx --extra-index-url $PIP_EXTRA_INDEX"; \
    if [ "$WITH_TORCH" = 1 ]; then \
      whl="$(ls /tmp/wheels/torch-*.whl 2>/dev/null | head -n 1 || true)"; \
      if [ -n "$whl" ]; then python -m pip install $idx "$whl"; \
      elif [ -n "$TORCH_SPEC" ] && [ -n "$TORCH_INDEX_URL" ]; then python -m pip install $idx --extra-index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"; \
      elif [ -n "$TORCH_INDEX_URL" ]; then python -m pip install $idx --extra-index-url "$TORCH_INDEX_URL" torch; \
      elif [ -n "$TORCH_SPEC" ]; then python -m pip install $idx "$TORCH_SPEC"; \
      else echo "ERROR: no CPU torch source: put torch-*.whl in infra/docker/wheels/, pass --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu, or --build-arg WITH_TORCH=0" >&2; exit 1; \
      fi; \
      python -c "import torch; assert torch.version.cuda is None, 'got a CUDA torch: ' + torch.__version__; print('torch', torch.__version__)"; \
    fi; \
    rm -rf /tmp/wheels

# 3. the project's runtime dependencies (from pyproject.toml; torch handled above)
COPY pyproject.toml /src/pyproject.toml
RUN set -eu; \
    idx=""; [ -n "$PIP_INDEX" ] && idx="--index-url $PIP_INDEX"; \
    [ -n "$PIP_EXTRA_INDEX" ] && idx="$idx --extra-index-url $PIP_EXTRA_INDEX"; \
    python -c "import re, tomllib; deps = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']['dependencies']; \
open('/tmp/requirements.txt', 'w').write('\n'.join(d for d in deps if re.match(r'[A-Za-z0-9._-]+', d).group().lower() != 'torch') + '\n')"; \
    cat /tmp/requirements.txt; \
    python -m pip install $idx -r /tmp/requirements.txt; \
    rm -f /tmp/requirements.txt

# 4. the project itself
COPY pyproject.toml README.m[d] /src/
COPY orchestrator/ /src/orchestrator/
COPY workloads/ /src/workloads/
COPY flows/ /src/flows/
RUN set -eu; \
    idx=""; [ -n "$PIP_INDEX" ] && idx="--index-url $PIP_INDEX"; \
    [ -n "$PIP_EXTRA_INDEX" ] && idx="$idx --extra-index-url $PIP_EXTRA_INDEX"; \
    [ -f /src/README.md ] || echo "# openlab" > /src/README.md; \
    python -m pip install $idx --no-deps /src; \
    rm -rf /src; \
    cd /tmp && python -c "import orchestrator, workloads, flows; print('openlab installed')"

# The interpreter the Docker launcher runs its usage wrapper with (launchers/_usage.py): an image
# that names one has what its jobs used (CPU seconds, peak memory) recorded in lineage.
LABEL openlab.io/python="python"
