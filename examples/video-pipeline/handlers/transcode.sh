#!/bin/sh
# transcode: {"source": "...", "renditions": [720, ...]} → one MP4 per rendition next to the
# source. Output names carry the idempotency key, so a re-run overwrites its own files
# instead of adding new ones.
set -eu
src=$(printf '%s' "$CONVEYOR_PAYLOAD" | jq -r .source)
key=$CONVEYOR_IDEMPOTENCY_KEY
out=""
for height in $(printf '%s' "$CONVEYOR_PAYLOAD" | jq -r '.renditions[]'); do
  dst="${src%.*}-${height}p-${key}.mp4"
  ffmpeg -nostdin -loglevel error -y -i "$src" -vf "scale=-2:${height}" -c:v libx264 -preset veryfast -c:a aac "$dst"
  out="$out\"$dst\","
done
printf '{"outputs": [%s]}\n' "${out%,}"
