# Background processes known by their pid files, $PID_DIR/<name>.pid (sourced by
# cluster/up.sh and scripts/stack.sh, which set PID_DIR).

running() { [ -f "$PID_DIR/$1.pid" ] && kill -0 "$(cat "$PID_DIR/$1.pid")" 2>/dev/null; }

# Stops <name>: SIGTERM, up to 30 s to exit, then SIGKILL. Removes its pid file and the
# notes kept beside it (<name>.stamp, <name>.cmd). Succeeds when it was not running.
stop_process() {
  running "$1" || { rm -f "$PID_DIR/$1.pid"; return 0; }
  local pid; pid=$(cat "$PID_DIR/$1.pid")
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$PID_DIR/$1.pid" "$PID_DIR/$1.stamp" "$PID_DIR/$1.cmd"
}

# Starts <name> running <command...>, its output in <log>, in a session of its own (so that an
# interrupt of whoever ran this does not reach it). A no-op while it runs with the same
# command line; restarted when that changed (kept in <name>.cmd). Callers define `log`.
start_process() { # name, log, command...
  local name=$1 out=$2; shift 2
  if running "$name"; then
    [ "$(cat "$PID_DIR/$name.cmd" 2>/dev/null)" = "$*" ] && return 0
    log "restarting $name for its new command line"
    stop_process "$name"
  fi
  nohup setsid "$@" >"$out" 2>&1 &
  echo $! >"$PID_DIR/$name.pid"
  echo "$*" >"$PID_DIR/$name.cmd"
  log "started $name (log $out)"
}
