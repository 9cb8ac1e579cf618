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
