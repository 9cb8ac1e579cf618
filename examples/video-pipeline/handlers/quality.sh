#!/bin/sh
# quality-analysis: {"source", "reference", "metric": psnr|ssim} → the average score.
set -eu
src=$(printf '%s' "$CONVEYOR_PAYLOAD" | jq -r .source)
ref=$(printf '%s' "$CONVEYOR_PAYLOAD" | jq -r .reference)
metric=$(printf '%s' "$CONVEYOR_PAYLOAD" | jq -r '.metric // "ssim"')
score=$(ffmpeg -nostdin -i "$src" -i "$ref" -lavfi "[0:v][1:v]scale2ref[a][b];[a][b]$metric" -f null - 2>&1 \
  | sed -n "s/.*All:\([0-9.inf]*\).*/\1/p; s/.*average:\([0-9.inf]*\).*/\1/p" | tail -1)
[ -n "$score" ] || { echo "ffmpeg reported no $metric score" >&2; exit 1; }
printf '{"metric": "%s", "score": "%s"}\n' "$metric" "$score"
