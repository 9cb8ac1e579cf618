# Shared by the example handlers (sourced; the handler's first argument is the media root,
# set in the WorkerPool's command, never by a payload).
#
# A payload names input files only relative to the media root: no URL, no absolute path,
# nothing that resolves outside the root or into another namespace's outputs, nothing that
# ffmpeg could read as an option.
# Outputs go to <root>/out/<namespace>/<idempotency key>/ under names the handler chooses,
# and results name them relative to the root (so they can be the input of a later task).
set -eu
root=$(realpath -e -- "${1:?usage: $0 MEDIA_ROOT}")

refuse() { echo "$*" >&2; exit 2; }

# media FIELD → the absolute path of the existing file the payload's FIELD names.
media() {
  rel=$(printf '%s' "$CONVEYOR_PAYLOAD" | jq -r --arg f "$1" '.[$f] // empty | strings')
  case "$rel" in
    "") refuse "$1 must name a file relative to the media root" ;;
    /* | *://* | *:* | -*) refuse "$1 must be a path relative to the media root, not $rel" ;;
  esac
  path=$(realpath -e -- "$root/$rel" 2>/dev/null) || refuse "$1: no file $rel under the media root"
  case "$path" in "$root"/*) ;; *) refuse "$1: $rel leaves the media root" ;; esac
  # Outputs are per namespace: another namespace's are not this task's to read.
  case "$path" in
    "$root/out/${CONVEYOR_NAMESPACE:-default}"/*) ;;
    "$root"/out/*) refuse "$1: $rel is another namespace's output" ;;
  esac
  printf '%s' "$path"
}

# The attempt's output directory (a re-run writes over its own files, never new ones).
outdir() {
  dir="$root/out/${CONVEYOR_NAMESPACE:-default}/$CONVEYOR_IDEMPOTENCY_KEY"
  mkdir -p "$dir"
  printf '%s' "$dir"
}

# An absolute path under the root, as results name it.
relative() { printf '%s' "${1#"$root"/}"; }

# A whole number from the payload's FIELD, or DEFAULT.
number() {
  value=$(printf '%s' "$CONVEYOR_PAYLOAD" | jq -r --arg f "$1" --arg d "$2" '.[$f] // ($d | tonumber)')
  case "$value" in '' | *[!0-9.]*) refuse "$1 must be a number" ;; esac
  printf '%s' "$value"
}
