# syntax=docker/dockerfile:1
# Conveyor: one image for every role (`conveyor api|dispatcher|worker|maintenance|migrate|...`).
#
#   DOCKER_BUILDKIT=1 docker build -t conveyor:0.1.0 .
#
# The builder compiles the release binary with the committed Cargo.lock (--locked); BuildKit cache mounts keep the
# crate registry and the target directory between builds, so a source change recompiles only Conveyor itself. The
# run-time image is distroless (glibc, CA certificates, tzdata; no shell, no package manager) and runs as the non-root
# user 65532, which the Helm chart's securityContext expects.

ARG RUST_VERSION=1

FROM rust:${RUST_VERSION}-bookworm AS builder
WORKDIR /src
# Only what the build reads: the workspace's manifest and lock, the platform's sources and embedded migrations, the
# shop and server crates, and the files of every target a manifest declares (the platform's benchmarks, examples and
# integration tests, the server's benchmarks): Cargo refuses a manifest whose targets are missing.
COPY Cargo.toml Cargo.lock build.rs ./
COPY src ./src
COPY migrations ./migrations
COPY benches ./benches
COPY examples ./examples
COPY tests ./tests
COPY shop ./shop
COPY server ./server
# Stamped into conveyor_build_info{revision} (pass --build-arg CONVEYOR_GIT_REVISION=$(git rev-parse --short HEAD)).
ARG CONVEYOR_GIT_REVISION=unknown
ENV CONVEYOR_GIT_REVISION=${CONVEYOR_GIT_REVISION}
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --locked --release --bin conveyor \
    && install -D -m 0755 target/release/conveyor /out/conveyor

FROM gcr.io/distroless/cc-debian12:nonroot AS runtime
LABEL org.opencontainers.image.title="conveyor" \
      org.opencontainers.image.description="Transactional outbox, idempotent writes and Redis Streams workers" \
      org.opencontainers.image.source="https://github.com/conveyor/conveyor" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=builder /out/conveyor /conveyor
# Listen on every interface in a container (the binary's defaults are loopback); the chart sets them too.
ENV CONVEYOR_HTTP_ADDR=0.0.0.0:8080 \
    CONVEYOR_ADMIN_ADDR=0.0.0.0:9090 \
    CONVEYOR_LOG_JSON=true
EXPOSE 8080 9090
USER 65532:65532
ENTRYPOINT ["/conveyor"]
CMD ["--help"]
