#!/bin/sh
# light MEDIA_ROOT — thumbnail: {"source", "atSeconds"?, "width"?} → a JPEG;
# metadata: {"source"} → ffprobe JSON (lib.sh says what a payload may name).
. "$(dirname "$0")/lib.sh"
src=$(media source)
case "$CONVEYOR_TASK_TYPE" in
  thumbnail)
    at=$(number atSeconds 1)
    width=$(number width 320)
    dst="$(outdir)/thumbnail.jpg"
    ffmpeg -nostdin -loglevel error -y -protocol_whitelist file -ss "$at" -i "file:$src" \
      -frames:v 1 -vf "scale=${width%.*}:-2" "file:$dst"
    printf '{"thumbnail": "%s"}\n' "$(relative "$dst")"
    ;;
  metadata)
    ffprobe -v error -protocol_whitelist file -print_format json -show_format -show_streams "file:$src"
    ;;
  *) refuse "unexpected task type $CONVEYOR_TASK_TYPE" ;;
esac
