# One image for every role; docker-compose.yml picks the command.
FROM python:3.11-slim

RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# CPU torch by default; GPU images pass e.g. TORCH_SPEC="torch==2.13.0" with a CUDA index configured.
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install --no-cache-dir "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY workers ./workers
COPY migrations ./migrations
# Portable llama.cpp build: the image must run on any x86-64-v3 host.
ENV CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
RUN pip install --no-cache-dir '.[api]' flower
ENV BONSAI_HOME=/data BONSAI_ARTIFACT_ROOT=/data/artifacts
ENTRYPOINT []
