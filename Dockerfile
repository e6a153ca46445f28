# syntax=docker/dockerfile:1
# One image, every specd entrypoint: `python -m services.draft | services.target | services.coordinator`,
# `specd models fetch` (the init step), `specd health` (probes) and Ray Serve (services/ray_app.py, KubeRay).
# Model weights are never baked in: they live in a volume at /models, fetched and sha256-verified by
# `specd models fetch`.
#
#   CPU (dev):            docker build -t specd:cpu .
#   GPU (CUDA 12.6):      docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126 -t specd:cuda .
#
# The CUDA build is CUDA-capable through torch's CUDA wheel, which carries the CUDA runtime
# libraries; the host's NVIDIA container toolkit provides the driver.
#
# What goes in is pinned: the base image by digest (the tag says which it is; to move it, take the
# new digest from `docker buildx imagetools inspect python:3.11-slim-bookworm`), every Python
# package by version and sha256 (requirements/image.lock, installed with --require-hashes), torch
# by version from the PyTorch index of the hardware (its CPU and CUDA builds are different files).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:0bee7276f83efd4a1ee05bbbf4281d95ed28e079220a9457f25a93e3f1e3c31b
FROM ${PYTHON_IMAGE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
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
# 1. Every dependency, exactly as locked (hashes checked; --no-deps: nothing unlocked comes in).
# 2. torch, from the index that matches the hardware; its requirements are installed by step 1
#    (what it still fetches is the CUDA build's own CUDA libraries, from the same index).
COPY requirements/image.lock requirements/
RUN pip install --no-cache-dir --require-hashes --no-deps -r requirements/image.lock \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX}" torch==2.13.0
# 3. specd itself, the source tree (DL3013 would have a version pin on "."), built with the locked
#    setuptools and nothing else; `pip check`: every requirement of every package is met.
COPY pyproject.toml README.md ./
COPY specd ./specd
COPY services ./services
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --no-deps --no-build-isolation . \
    && pip check \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin specd \
    && mkdir -p /models \
    && chown specd /models

USER 10001
VOLUME ["/models"]
# coordinator gRPC + REST, draft, target, metrics (draft, target)
EXPOSE 50051 8000 50052 50053 9101 9102
CMD ["specd", "--help"]
