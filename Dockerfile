# syntax=docker/dockerfile:1
# One image, every specd entrypoint: `python -m services.draft | services.target | services.coordinator`,
# `specd models fetch` (the init step) and `specd health` (probes). Model weights are never baked in:
# they live in a volume at /models, fetched and sha256-verified by `specd models fetch`.
#
#   CPU (dev):            docker build -t specd:cpu .
#   GPU (CUDA 12.6):      docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126 -t specd:cuda .
#
# The CUDA build is CUDA-capable through torch's CUDA wheel, which carries the CUDA runtime
# libraries; the host's NVIDIA container toolkit provides the driver.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# `ray` adds Ray Serve for services/ray_app.py (KubeRay); build with --build-arg EXTRAS=none to leave it out.
ARG EXTRAS=ray
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPECD_MODELS_DIR=/models \
    SPECD_HOST=0.0.0.0

WORKDIR /app
# A C compiler: specd builds its GGUF kernels for the CPU it runs on at first use (specd/native.py).
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
# torch first, from the index that matches the hardware; then this project (DL3013 would have
# a version pin on ".", which is the source tree itself; its dependencies are pinned in pyproject).
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" torch==2.13.0
COPY pyproject.toml README.md ./
COPY specd ./specd
COPY services ./services
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[${EXTRAS}]" \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin specd \
    && mkdir -p /models \
    && chown specd /models

USER 10001
VOLUME ["/models"]
# coordinator gRPC + REST, draft, target, metrics (draft, target)
EXPOSE 50051 8000 50052 50053 9101 9102
CMD ["specd", "--help"]
