#!/bin/sh
# transcode MEDIA_ROOT: {"source": "<relative path>", "renditions": [720, ...]} → one MP4 per
# rendition under the task's output directory (lib.sh says what a payload may name).
. "$(dirname "$0")/lib.sh"
src=$(media source)
dir=$(outdir)
out=""
for height in $(printf '%s' "$CONVEYOR_PAYLOAD" | jq -r '.renditions[]? | numbers'); do
  dst="$dir/${height%.*}p.mp4"
  ffmpeg -nostdin -loglevel error -y -protocol_whitelist file -i "file:$src" \
    -vf "scale=-2:${height%.*}" -c:v libx264 -preset veryfast -c:a aac "file:$dst"
  out="$out\"$(relative "$dst")\","
done
[ -n "$out" ] || refuse "renditions must list at least one height"
printf '{"outputs": [%s]}\n' "${out%,}"
