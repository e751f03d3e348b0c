# kvserver daemon image.
#
# CUDA-agnostic: a plain python:3.11-slim base plus PyPI's torch wheel, which bundles its own CUDA
# runtime. With a GPU reserved (NVIDIA container toolkit, see docker-compose.yml) the driver is mounted
# in and the daemon can open engines' CUDA IPC handles; without one it still serves shared-memory pools.
#
#   docker build -t kvserver .
#   docker build --build-arg KVSERVER_EXTRAS=cuda -t kvserver .      # + the `cuda` extra (cupy-cuda12x)
#   docker build --build-arg KVSERVER_EXTRAS=cuda,cluster -t kvserver .   # + Mooncake Store (cluster tier)
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t kvserver:cpu .
FROM python:3.11-slim

# Optional extras of the kvserver package, comma-separated ("" for none, "cuda" for cupy-cuda12x).
ARG KVSERVER_EXTRAS=""
# Optional index to take torch from first (e.g. the CPU-only wheels); empty uses PyPI's default wheel.
ARG TORCH_INDEX_URL=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# libibverbs1: Mooncake Store's client (the `cluster` extra) loads it at import, for TCP too.
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
# Only what the wheel is built from: the project files (README.md if present) and the package folders
# setup.py finds packages in (it also builds the C copy kernel from kvserver/copies/csrc).
COPY pyproject.toml setup.py README.m[d] ./
COPY kvserver ./kvserver
COPY client ./client

RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install --index-url "$TORCH_INDEX_URL" "torch>=2.4"; fi \
    && pip install ".${KVSERVER_EXTRAS:+[$KVSERVER_EXTRAS]}" \
    && cd / && rm -rf /src \
    && kvserver --help > /dev/null

WORKDIR /
# Runs as root, so the default socket is /run/kvserver/kvserver.sock. The daemon creates it mode 0600:
# engines connecting through it must run as the same uid (root in the stock engine images).
STOPSIGNAL SIGTERM
CMD ["kvserver", "--socket", "/run/kvserver/kvserver.sock"]
