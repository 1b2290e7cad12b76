# kvmesh router image: `kvmesh router` and `kvmesh sidecar` (base install only, no engine extras).
#   docker build -f docker/router.Dockerfile -t ghcr.io/kvmesh/router:0.1.0 .
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HOME=/tmp HF_HOME=/tmp/hf
WORKDIR /src
COPY pyproject.toml README.md* ./
COPY kvmesh ./kvmesh
COPY engine ./engine
COPY router ./router
COPY sidecar ./sidecar
COPY operator ./operator
RUN pip install . && rm -rf /src

RUN useradd --uid 10001 --create-home --home-dir /home/kvmesh kvmesh
USER 10001
EXPOSE 8000
ENTRYPOINT ["kvmesh"]
CMD ["router"]
