//! One pod's process, kept alive like a kubelet would (restarted with back-off, as its
//! restartPolicy says: always, only after a failure, or never) until it is told to stop,
//! then stopped like one: SIGTERM to its process group, SIGKILL after the grace period.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::plan::Launch;

const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A process that ran this long before exiting starts its back-off afresh.
const HEALTHY_RUN: Duration = Duration::from_secs(60);

/// What a kubelet reports of a container: whether its process runs, since when, and how
/// often it was restarted.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProcessState {
    pub running_since: Option<SystemTime>,
    pub restarts: u32,
    /// Its exit code, once it exited for good (its restartPolicy says not to start it again).
    pub terminated: Option<i32>,
}

/// A running pod's supervisor: stop it with `stop`, wait for it with `join`.
pub struct Supervisor {
    stop: CancellationToken,
    task: JoinHandle<()>,
    state: Arc<Mutex<ProcessState>>,
}

impl Supervisor {
    /// Starts supervising `launch` for `pod` (namespace/name), its output appended to `log`.
    pub fn spawn(pod: String, launch: Launch, log: PathBuf) -> Self {
        let stop = CancellationToken::new();
        let state = Arc::new(Mutex::new(ProcessState::default()));
        let task = tokio::spawn(supervise(pod, launch, log, stop.clone(), state.clone()));
        Self { stop, task, state }
    }

    pub fn state(&self) -> ProcessState {
        *self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Asks the process to stop; `join` waits until it has.
    pub fn stop(&self) {
        self.stop.cancel();
    }

    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    pub async fn join(self) {
        if let Err(err) = self.task.await {
            tracing::error!(error = %err, "pod supervisor failed");
        }
    }
}

async fn supervise(
    pod: String,
    launch: Launch,
    log: PathBuf,
    stop: CancellationToken,
    state: Arc<Mutex<ProcessState>>,
) {
    let set = |change: &dyn Fn(&mut ProcessState)| {
        change(&mut state.lock().unwrap_or_else(|p| p.into_inner()));
    };
    let mut failures: u32 = 0;
    loop {
        let started = Instant::now();
        match start(&launch, &log) {
            Ok(mut child) => {
                let pid = child.id();
                tracing::info!(%pod, ?pid, log = %log.display(), "process started");
                set(&|s| s.running_since = Some(SystemTime::now()));
                tokio::select! {
                    status = child.wait() => {
                        // Killed by a signal: 128 + its number, as a container runtime says.
                        let code = status.as_ref().ok().and_then(|s| {
                            use std::os::unix::process::ExitStatusExt;
                            s.code().or_else(|| s.signal().map(|n| 128 + n))
                        }).unwrap_or(-1);
                        if !launch.restart.after(code) {
                            tracing::info!(%pod, code, "process exited; not restarted (restartPolicy)");
                            set(&|s| {
                                s.running_since = None;
                                s.terminated = Some(code);
                            });
                            stop.cancelled().await;
                            return;
                        }
                        tracing::warn!(%pod, ?status, "process exited; restarting it");
                        set(&|s| {
                            s.running_since = None;
                            s.restarts += 1;
                        });
                    }
                    () = stop.cancelled() => {
                        terminate(&pod, &mut child, launch.grace).await;
                        return;
                    }
                }
            }
            Err(err) => {
                tracing::error!(%pod, program = %launch.program.display(), error = %err, "cannot start process");
                set(&|s| s.restarts += 1);
            }
        }
        failures = if started.elapsed() > HEALTHY_RUN {
            1
        } else {
            failures + 1
        };
        let backoff = Duration::from_secs(1 << failures.min(5)).min(MAX_BACKOFF);
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            () = stop.cancelled() => return,
        }
    }
}

fn start(launch: &Launch, log: &PathBuf) -> std::io::Result<Child> {
    for dir in &launch.dirs {
        std::fs::create_dir_all(dir)?;
    }
    for (path, content) in &launch.files {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(path, content)?;
    }
    if let Some(parent) = log.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    Command::new(&launch.program)
        .args(&launch.args)
        .env_clear()
        .envs(launch.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        // Its own process group, so that handler processes go with it, as in a container.
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
}

async fn terminate(pod: &str, child: &mut Child, grace: Duration) {
    let Some(pid) = child.id().and_then(|id| i32::try_from(id).ok()) else {
        return;
    };
    let group = Pid::from_raw(pid);
    tracing::info!(%pod, pid, ?grace, "stopping process (SIGTERM)");
    let _ = killpg(group, Signal::SIGTERM);
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        tracing::warn!(%pod, pid, "grace period over (SIGKILL)");
        let _ = killpg(group, Signal::SIGKILL);
        let _ = child.wait().await;
    }
    // Handler processes the worker left behind go too, as a container's would.
    let _ = killpg(group, Signal::SIGKILL);
    tracing::info!(%pod, pid, "process stopped");
}
