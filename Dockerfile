# One small image with every Conveyor binary, plus ffmpeg, ffprobe and jq for the example
# video pipeline's exec handlers. Runs as a non-root user (65532).
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p conveyor-gateway -p conveyor-worker -p conveyor-operator -p conveyorctl \
 && install -D -t /out target/release/conveyor-gateway target/release/conveyor-worker \
      target/release/conveyor-operator target/release/conveyorctl

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates ffmpeg jq \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/ /usr/local/bin/
COPY examples/video-pipeline/handlers/ /usr/local/lib/conveyor/handlers/
USER 65532:65532
ENTRYPOINT ["conveyor-worker"]
