#!/usr/bin/env bash
# The release before this checkout's, as its users hold it: its chart and its binaries, made
# once from its commit into $CONVEYOR_CACHE/releases/<version>/ (bin/ and chart/), then
# reused. The e2e suite's chart upgrade installs that chart, whose pods (image tag
# <version>) the local pod runner starts from bin/ (its --releases), then upgrades the
# release to this checkout's chart. Prints the release's folder.
#
# Its binaries are built in this checkout's target/ (the dependencies are mostly shared; its
# own crates compile apart, from another folder), then this checkout's are linked back in
# place: `cargo build` puts whichever it built last at target/debug/<name>.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/tools.sh

# 0.1.0: the last commit before 0.2.0's first migration (only the owner creates in public).
VERSION=0.1.0
COMMIT=25d71253fe8364719e2f4fe441819e04db7d2d91
BINARIES=(conveyor-gateway conveyor-operator conveyor-worker conveyorctl)

CACHE=${CONVEYOR_CACHE:-$HOME/.cache/conveyor}
OUT=$CACHE/releases/$VERSION
log() { printf 'previous-release: %s\n' "$*" >&2; }

if [ "$(cat "$OUT/commit" 2>/dev/null)" = "$COMMIT" ]; then
  echo "$OUT"
  exit 0
fi
need_toolchains cargo
need_packages objcopy=binutils
git cat-file -e "$COMMIT^{commit}" 2>/dev/null || {
  log "this clone lacks commit $COMMIT ($VERSION); a shallow clone needs: git fetch --unshallow"
  exit 1
}

log "building $VERSION from ${COMMIT:0:12} (once; 2 minutes with the dependencies built, about 10 on a cold target/)"
# A fixed folder, so that a rebuild after an interruption reuses the compiled crates.
src=$CACHE/releases/src-$VERSION
rm -rf "$src" "$OUT"
mkdir -p "$src" "$OUT/bin"
git archive "$COMMIT" | tar -x -C "$src"
packages=()
for name in "${BINARIES[@]}"; do packages+=(--bin "$name"); done
# From this build until the last line, target/debug/<name> are 0.1.0's: this checkout's are
# linked back in place however the script ends (an interrupt or a failure included).
trap 'cargo build -q --bins' EXIT
cargo build -q --locked --manifest-path "$src/Cargo.toml" --target-dir "$PWD/target" "${packages[@]}"
# Debug info stripped: a quarter of the size.
for name in "${BINARIES[@]}"; do objcopy --strip-debug "target/debug/$name" "$OUT/bin/$name"; done
cp -r "$src/charts/conveyor" "$OUT/chart"
# This checkout's binaries back at target/debug (a fresh build only links them again).
trap - EXIT
cargo build -q --bins
rm -rf "$src"
echo "$COMMIT" >"$OUT/commit"
log "$VERSION: $("$OUT/bin/conveyorctl" --version) in $OUT"
echo "$OUT"
