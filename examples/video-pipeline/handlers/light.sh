#!/bin/sh
# thumbnail: {"source", "atSeconds"?, "width"?} → a JPEG; metadata: {"source"} → ffprobe JSON.
set -eu
src=$(printf '%s' "$CONVEYOR_PAYLOAD" | jq -r .source)
case "$CONVEYOR_TASK_TYPE" in
  thumbnail)
    at=$(printf '%s' "$CONVEYOR_PAYLOAD" | jq -r '.atSeconds // 1')
    width=$(printf '%s' "$CONVEYOR_PAYLOAD" | jq -r '.width // 320')
    dst="${src%.*}-thumb-${CONVEYOR_IDEMPOTENCY_KEY}.jpg"
    ffmpeg -nostdin -loglevel error -y -ss "$at" -i "$src" -frames:v 1 -vf "scale=${width}:-2" "$dst"
    printf '{"thumbnail": "%s"}\n' "$dst"
    ;;
  metadata)
    ffprobe -v error -print_format json -show_format -show_streams "$src"
    ;;
  *) echo "unexpected task type $CONVEYOR_TASK_TYPE" >&2; exit 2 ;;
esac
