# Sourced by the scripts: the tools they use, checked before anything starts, with what is
# missing said in one line. Tools that come as Debian packages are installed; the toolchains
# (Rust, Go) a newcomer installs once, as the README says.

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# Installs the Debian packages of the commands that are missing: need_packages cmd=pkg ...
need_packages() {
  local missing=() pair
  for pair in "$@"; do
    command -v "${pair%%=*}" >/dev/null 2>&1 || missing+=("${pair#*=}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  install_debian_packages "${missing[@]}"
}

install_debian_packages() {
  printf 'tools: installing %s from Debian packages\n' "$*" >&2
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# Fails, naming every missing toolchain command at once, with where each comes from:
# need_toolchains cargo go ...
need_toolchains() {
  local missing=() hints=() cmd
  for cmd in "$@"; do
    command -v "$cmd" >/dev/null 2>&1 && continue
    missing+=("$cmd")
    case "$cmd" in
      cargo | rustc) hints+=("Rust from rustup (https://rustup.rs)") ;;
      go) hints+=("Go 1.26 (https://go.dev/dl)") ;;
      gcc | make) hints+=("apt-get install build-essential") ;;
      *) hints+=("apt-get install $cmd") ;;
    esac
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local IFS=';'
  printf 'tools: missing %s; install: %s; then run this again (as a sudoer, run make without sudo: sudo drops ~/.cargo/bin and Go from PATH)\n' \
    "$(printf '%s' "${missing[*]}" | sed 's/;/, /g')" "$(printf '%s' "${hints[*]}" | sed 's/;/, /g')" >&2
  exit 1
}
