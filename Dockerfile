# skippyd in a container (see docs/operations.md, "Docker").
#
#   docker build -t skippyd .
#   docker volume create skippyd-run
#   docker run -d --name skippyd --shm-size=20g -v skippyd-run:/run/skippyd \
#       -v skippyd-state:/var/lib/skippyd -e SKIPPYD_L2_BUDGET=16GiB skippyd
#   docker run ... -v skippyd-run:/run/skippyd --group-add 10001 <engine image>   # engines
#
# The L2 tier lives in the container's /dev/shm: Docker gives it 64 MB unless --shm-size (or a
# --tmpfs /dev/shm/skippyd:size=...,uid=10001,gid=10001,mode=0700 mount, or the host's
# -v /dev/shm/skippyd:/dev/shm/skippyd) makes room for SKIPPYD_L2_BUDGET. It is deliberately not a
# VOLUME: an anonymous volume would put the "shared memory" tier on disk.
# Extra arguments after the image name go to `skippyd serve` (e.g. --metrics-addr 0.0.0.0:9400).

# ---------------------------------------------------------------------------------------------- build
# gcc compiles the optional C extension skippyd._chain; every dependency becomes a wheel in /wheels so
# the runtime stage installs offline and carries no compiler.
FROM python:3.11-slim AS build

# Debian package versions are not pinned: the python:3.11-slim tag moves with Debian point releases.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml setup.py README.md MANIFEST.in ./
COPY skippyd ./skippyd
COPY lua ./lua
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# -------------------------------------------------------------------------------------------- runtime
FROM python:3.11-slim

ARG SKIPPYD_UID=10001
ARG SKIPPYD_GID=10001

# redis-server backs the embedded default (a private Redis under the state directory). No torch: the
# daemon moves bytes; only the engines' client library builds tensors.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid "${SKIPPYD_GID}" skippyd \
    && useradd --system --uid "${SKIPPYD_UID}" --gid skippyd --home-dir /var/lib/skippyd \
        --no-create-home --shell /usr/sbin/nologin skippyd \
    && install -d -o skippyd -g skippyd -m 0750 /run/skippyd /var/lib/skippyd \
    && install -d -o skippyd -g skippyd -m 0700 /var/lib/skippyd/l3

COPY --from=build /wheels /tmp/wheels
RUN pip install --no-cache-dir --no-index /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels \
    && python -c "import skippyd._chain" \
    && skippyd --version

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SKIPPYD_SOCKET=/run/skippyd/skippyd.sock

# /run/skippyd: the socket (0660, group skippyd), shared with engine containers.
# /var/lib/skippyd: the embedded Redis's append-only file and the L3 disk tier (l3/; mount a fast
# disk there with -v /nvme/skippyd-l3:/var/lib/skippyd/l3).
VOLUME ["/run/skippyd", "/var/lib/skippyd"]

# Prometheus metrics, only when started with --metrics-addr 0.0.0.0:9400 (off by default).
EXPOSE 9400

USER ${SKIPPYD_UID}:${SKIPPYD_GID}
WORKDIR /var/lib/skippyd

# Start-up verifies every L2 entry still on tmpfs before the socket appears: allow for it. Exit 4 (degraded:
# its Redis is away, it still serves every request) is healthy here, so an orchestrator that restarts
# unhealthy containers does not restart every node for a shared Redis that is down.
HEALTHCHECK --interval=30s --timeout=10s --start-period=5m --retries=3 \
    CMD ["sh", "-c", "skippyd status --check --socket /run/skippyd/skippyd.sock || [ $? -eq 4 ]"]

STOPSIGNAL SIGTERM
ENTRYPOINT ["skippyd", "serve", "--socket", "/run/skippyd/skippyd.sock", "--state-dir", "/var/lib/skippyd", "--shm-dir", "/dev/shm/skippyd"]
CMD []
