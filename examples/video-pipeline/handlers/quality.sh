#!/bin/sh
# quality MEDIA_ROOT — quality-analysis: {"source", "reference", "metric": psnr|ssim} → the
# average score (lib.sh says what a payload may name).
. "$(dirname "$0")/lib.sh"
src=$(media source)
ref=$(media reference)
metric=$(printf '%s' "$CONVEYOR_PAYLOAD" | jq -r '.metric // "ssim"')
case "$metric" in psnr | ssim) ;; *) refuse "metric must be psnr or ssim" ;; esac
score=$(ffmpeg -nostdin -protocol_whitelist file -i "file:$src" -i "file:$ref" \
  -lavfi "[0:v][1:v]scale2ref[a][b];[a][b]$metric" -f null - 2>&1 \
  | sed -n "s/.*All:\([0-9.inf]*\).*/\1/p; s/.*average:\([0-9.inf]*\).*/\1/p" | tail -1)
[ -n "$score" ] || { echo "ffmpeg reported no $metric score" >&2; exit 1; }
printf '{"metric": "%s", "score": "%s"}\n' "$metric" "$score"
