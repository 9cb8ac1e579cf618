#!/usr/bin/env bash
# The import edges between a crate's top-level modules, and whether they form a circle.
# An edge `a b` means a file of module `a` names `crate::b`; the crate root (lib.rs,
# main.rs) is left out, since it declares every module. Exits 1 when the edges have a loop.
#
#   scripts/module-edges.sh gateway          edges of gateway/src, then "no loop" or the loop
#   scripts/module-edges.sh gateway --quiet  only the verdict
set -euo pipefail
cd "$(dirname "$0")/.."
crate=${1:?usage: $0 CRATE_DIR [--quiet]}
src=$crate/src
[ -d "$src" ] || { echo "module-edges: no $src" >&2; exit 2; }

edges=$(
  find "$src" -name '*.rs' ! -path "$src/lib.rs" ! -path "$src/main.rs" ! -path "$src/bin/*" |
    sort | while read -r file; do
      rel=${file#"$src"/}
      module=${rel%%/*}; module=${module%.rs}
      # `crate::x` anywhere (use lines, paths in code), and `use crate::{x, y}` groups.
      { grep -v '^\s*//' "$file" |
        grep -oE 'crate::(\{[^}]*\}|[a-z_][a-z0-9_]*)' |
        sed -E 's/^crate:://; s/[{}]//g' | tr ',' '\n' | sed -E 's/^\s+//; s/::.*//; s/\s.*//' |
        grep -E '^[a-z_][a-z0-9_]*$' | grep -vx "$module" | sort -u || true; } |
        while read -r target; do
          # Only modules of this crate (a file or folder of that name under src).
          if [ -f "$src/$target.rs" ] || [ -d "$src/$target" ]; then echo "$module $target"; fi
        done
    done | sort -u
)
[ "${2:-}" = --quiet ] || { echo "$edges"; echo; }
if loop=$(echo "$edges" | tsort 2>&1 >/dev/null) && [ -z "$loop" ]; then
  echo "$crate: $(echo "$edges" | grep -c .) edges between its modules, no loop"
else
  echo "$crate: the modules import each other in a loop. Pairs that import each other:"
  echo "$edges" | while read -r a b; do
    if [[ "$a" < "$b" ]] && echo "$edges" | grep -qx "$b $a"; then echo "  $a <-> $b"; fi
  done
  echo "tsort's loops (longer ones too):"
  echo "$loop" | sed -n 's/^tsort: //p' | grep -v 'input contains a loop' | sed 's/^/  /'
  exit 1
fi
