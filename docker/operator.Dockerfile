# kvmesh operator image: `kvmesh operator` (kopf; no torch).
#   docker build -f docker/operator.Dockerfile -t ghcr.io/kvmesh/operator:0.1.0 .
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HOME=/tmp
WORKDIR /src
COPY pyproject.toml README.md* ./
COPY kvmesh ./kvmesh
COPY engine ./engine
COPY router ./router
COPY sidecar ./sidecar
COPY operator ./operator
RUN pip install '.[operator]' && rm -rf /src

RUN useradd --uid 10001 --no-create-home kvmesh
USER 10001
EXPOSE 8080
ENTRYPOINT ["kvmesh"]
CMD ["operator", "--liveness-port", "8080"]
