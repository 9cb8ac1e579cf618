//! The `exec` handler: one process (group) per attempt.
//!
//! - The command runs in a process group of its own, and the whole group is killed when the
//!   attempt ends, times out or is cancelled: `ffmpeg` started by a wrapper script does not
//!   outlive its task.
//! - The payload goes to stdin while stdout and stderr are read, all at once, so a command
//!   that writes before it reads cannot deadlock against us.
//! - Output is bounded: stdout up to [`MAX_STDOUT`] (a larger result is a failure: write
//!   large outputs to storage and print a reference), the last [`MAX_STDERR`] of stderr.
//! - `CONVEYOR_PAYLOAD` holds the payload only up to [`MAX_ENV_PAYLOAD`] (Linux refuses a
//!   larger environment string with E2BIG); larger payloads come on stdin alone, and
//!   `CONVEYOR_PAYLOAD_ON_STDIN=1` says so.
//! - The environment is scrubbed: the command gets [`PASSED_ENV`], the names listed in the
//!   worker's `CONVEYOR_HANDLER_PASS_ENV` (comma-separated; never a `CONVEYOR_` one), and
//!   the task's own `CONVEYOR_*` variables. The worker's database and broker URLs, with
//!   their passwords, never reach a handler (`docs/security.md`).

use std::process::Stdio;

use conveyor_core::task::TaskMessage;
use conveyor_core::task_type::split_key;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

use super::progress_file::ProgressFile;
use super::{tail, Failure};
use crate::progress::ProgressSink;
use tokio_util::sync::CancellationToken;

/// Variables of the worker's environment every handler process gets.
pub const PASSED_ENV: &[&str] = &[
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR",
];

/// What a handler process inherits from the worker's environment, read once: the worker's
/// environment does not change while it runs.
fn inherited() -> &'static [(String, String)] {
    static INHERITED: std::sync::OnceLock<Vec<(String, String)>> = std::sync::OnceLock::new();
    INHERITED.get_or_init(|| {
        let listed = std::env::var("CONVEYOR_HANDLER_PASS_ENV").unwrap_or_default();
        let extra: Vec<&str> = listed
            .split(',')
            .map(str::trim)
            .filter(|name| !name.is_empty() && !name.starts_with("CONVEYOR_"))
            .collect();
        std::env::vars()
            .filter(|(name, _)| {
                PASSED_ENV.contains(&name.as_str()) || extra.contains(&name.as_str())
            })
            .collect()
    })
}

/// Opens descriptor 3 on the progress file, then becomes the command (same pid, same process
/// group): the shell does between fork and exec what Rust could only do with `unsafe` code.
/// `$0` is the command, `$@` its arguments, passed through untouched.
const WITH_PROGRESS_FD: &str = r#"exec 3>>"$CONVEYOR_PROGRESS_FILE" && exec "$0" "$@""#;

/// Largest payload also passed in the environment.
pub const MAX_ENV_PAYLOAD: usize = 64 * 1024;
/// Largest stdout kept as the result.
pub const MAX_STDOUT: usize = 1024 * 1024;
/// How much of the end of stderr is kept for the failure message.
pub const MAX_STDERR: usize = 64 * 1024;

/// Kills the command's whole process group when dropped: on success (a daemonized helper
/// left behind), on failure, and when the attempt's future is dropped by its timeout.
struct Group(Option<Pid>);

impl Drop for Group {
    fn drop(&mut self) {
        if let Some(group) = self.0 {
            // ESRCH (the group is gone already) is the common case.
            let _ = killpg(group, Signal::SIGKILL);
        }
    }
}

pub async fn run(
    command: &str,
    args: &[String],
    task: &TaskMessage,
    progress: &ProgressSink,
) -> Result<serde_json::Value, Failure> {
    let payload = task.payload.to_string();
    // The handler sees the TaskType's own name and its namespace, not the type's key.
    let (namespace, local) = split_key(&task.task_type);
    let progress_file = ProgressFile::create(task.id, task.attempt)
        .map_err(|e| format!("cannot make the progress file in the temporary directory: {e}"))?;
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c")
        .arg(WITH_PROGRESS_FD)
        .arg(command)
        .args(args)
        .env_clear()
        .envs(inherited().iter().map(|(k, v)| (k, v)))
        .env("CONVEYOR_TASK_ID", task.id.to_string())
        .env("CONVEYOR_TASK_TYPE", local)
        .env("CONVEYOR_NAMESPACE", namespace)
        .env("CONVEYOR_ATTEMPT", task.attempt.to_string())
        .env("CONVEYOR_IDEMPOTENCY_KEY", task.idempotency_key.to_string())
        .env("CONVEYOR_PROGRESS_FILE", progress_file.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    // W3C trace context: the handler's own spans, if it makes any, continue the trace.
    if let Some(traceparent) = &task.traceparent {
        cmd.env("TRACEPARENT", traceparent);
    }
    if payload.len() <= MAX_ENV_PAYLOAD {
        cmd.env("CONVEYOR_PAYLOAD", &payload);
    } else {
        cmd.env("CONVEYOR_PAYLOAD_ON_STDIN", "1");
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {command}: {e}"))?;
    let group = child
        .id()
        .and_then(|pid| i32::try_from(pid).ok())
        .map(Pid::from_raw);
    let _group = Group(group);
    let (stdin, stdout, stderr) = (child.stdin.take(), child.stdout.take(), child.stderr.take());
    let feed = async {
        if let Some(mut stdin) = stdin {
            // A command that does not read stdin closes the pipe early; not a failure.
            let _ = stdin.write_all(payload.as_bytes()).await;
        }
    };
    // Once the command itself exits, whatever it left running in its group (a helper that
    // inherited stdout, say) goes too: the pipes then close and the reads end.
    let ended = CancellationToken::new();
    let exited = async {
        let status = child.wait().await;
        drop(Group(group));
        ended.cancel();
        status
    };
    let (_, out, err, status, ()) = tokio::join!(
        feed,
        read_bounded(stdout, MAX_STDOUT, Keep::Head),
        read_bounded(stderr, MAX_STDERR, Keep::Tail),
        exited,
        progress_file.follow(progress, &ended)
    );
    let status = status.map_err(|e| format!("waiting for {command}: {e}"))?;
    let (stdout, stdout_cut) = out.map_err(|e| format!("reading {command}'s stdout: {e}"))?;
    let (stderr, _) = err.map_err(|e| format!("reading {command}'s stderr: {e}"))?;
    // The shell could not become the command: missing (127) or not executable (126), and
    // the shell said so (a command's own 127 is its own failure).
    let stderr_text = String::from_utf8_lossy(&stderr);
    if matches!(status.code(), Some(126 | 127)) && stderr_text.contains("exec: ") {
        return Err(format!("cannot start {command}: {}", tail(&stderr_text)));
    }
    if !status.success() {
        return Err(format!(
            "{command} exited with {status}: {}",
            tail(&String::from_utf8_lossy(&stderr))
        ));
    }
    if stdout_cut {
        return Err(format!(
            "{command} printed more than {MAX_STDOUT} bytes; a result must be smaller \
             (write large outputs to storage and print a reference)"
        ));
    }
    let stdout = String::from_utf8_lossy(&stdout);
    Ok(serde_json::from_str(stdout.trim())
        .unwrap_or_else(|_| serde_json::json!({ "stdout": tail(&stdout) })))
}

#[derive(Clone, Copy)]
enum Keep {
    Head,
    Tail,
}

/// Reads `from` to its end, keeping at most `limit` bytes (the first or the last); says
/// whether anything was cut. Reading on past the limit keeps the writer from blocking.
async fn read_bounded<R: AsyncRead + Unpin>(
    from: Option<R>,
    limit: usize,
    keep: Keep,
) -> std::io::Result<(Vec<u8>, bool)> {
    let Some(mut from) = from else {
        return Ok((Vec::new(), false));
    };
    let mut kept = Vec::new();
    let mut cut = false;
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        let n = from.read(&mut chunk).await?;
        if n == 0 {
            return Ok((kept, cut));
        }
        kept.extend_from_slice(&chunk[..n]);
        if kept.len() > limit {
            cut = true;
            match keep {
                Keep::Head => kept.truncate(limit),
                Keep::Tail => {
                    kept.drain(..kept.len() - limit);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn task(payload: serde_json::Value) -> TaskMessage {
        TaskMessage {
            id: uuid::Uuid::new_v4(),
            task_type: "t".into(),
            attempt: 0,
            idempotency_key: uuid::Uuid::new_v4(),
            payload,
            submitted_at: chrono::Utc::now(),
            suspect: false,
            traceparent: None,
        }
    }

    async fn sh(script: &str, payload: serde_json::Value) -> Result<serde_json::Value, Failure> {
        let progress = ProgressSink::detached();
        run(
            "sh",
            &["-c".to_owned(), script.to_owned()],
            &task(payload),
            &progress,
        )
        .await
    }

    fn alive(pid: i32) -> bool {
        nix::sys::signal::kill(Pid::from_raw(pid), None).is_ok()
    }

    #[tokio::test]
    async fn a_handler_sees_only_its_task_and_a_few_plain_variables() {
        // This test process has CARGO_* and whatever else the shell gave it; a worker has
        // CONVEYOR_DATABASE_URL with its password. None of it may reach the handler.
        let result = sh(
            "env | cut -d= -f1 | sort | tr '\\n' ' '",
            serde_json::json!({}),
        )
        .await
        .unwrap();
        let names = result["stdout"].as_str().unwrap_or_default().to_owned();
        let task_vars = [
            "CONVEYOR_TASK_ID",
            "CONVEYOR_TASK_TYPE",
            "CONVEYOR_NAMESPACE",
            "CONVEYOR_ATTEMPT",
            "CONVEYOR_IDEMPOTENCY_KEY",
            "CONVEYOR_PAYLOAD",
            "CONVEYOR_PROGRESS_FILE",
            "TRACEPARENT",
        ];
        // What sh sets for itself.
        let shell = ["PWD", "SHLVL", "_", "OLDPWD"];
        for name in names.split_whitespace() {
            assert!(
                PASSED_ENV.contains(&name) || task_vars.contains(&name) || shell.contains(&name),
                "{name} reached the handler: {names}"
            );
        }
        assert!(
            names.contains("PATH") && names.contains("CONVEYOR_TASK_ID"),
            "{names}"
        );
    }

    #[tokio::test]
    async fn a_timed_out_attempt_takes_its_whole_process_tree_with_it() {
        let pidfile = std::env::temp_dir().join(format!("conveyor-exec-{}", uuid::Uuid::new_v4()));
        // A wrapper script whose grandchild (ffmpeg, say) does the work.
        let script = format!("sleep 60 & echo $! > {}; wait", pidfile.display());
        let attempt = tokio::time::timeout(
            Duration::from_millis(500),
            sh(&script, serde_json::json!({})),
        );
        assert!(attempt.await.is_err(), "timed out");
        let pid: i32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while alive(pid) {
            assert!(
                std::time::Instant::now() < deadline,
                "grandchild {pid} outlived its task"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = std::fs::remove_file(pidfile);
    }

    #[tokio::test]
    async fn payloads_larger_than_the_environment_holds_arrive_on_stdin() {
        let big = "x".repeat(300 * 1024);
        let result = sh(
            "echo \"{\\\"bytes\\\": $(wc -c), \\\"flag\\\": \\\"$CONVEYOR_PAYLOAD_ON_STDIN\\\"}\"",
            serde_json::json!({ "big": big }),
        )
        .await
        .unwrap();
        assert!(result["bytes"].as_u64().unwrap() > 300 * 1024, "{result}");
        assert_eq!(result["flag"], "1");
    }

    #[tokio::test]
    async fn a_command_that_writes_before_it_reads_does_not_deadlock() {
        let big = "y".repeat(1024 * 1024);
        // 512 KiB on stdout before reading a 1 MiB stdin: both pipes fill up unless they
        // are served at once.
        let attempt = sh(
            "head -c 524288 /dev/zero | tr '\\0' a; cat > /dev/null; echo",
            serde_json::json!({ "big": big }),
        );
        let result = tokio::time::timeout(Duration::from_secs(20), attempt)
            .await
            .expect("no deadlock")
            .unwrap();
        assert!(result["stdout"].as_str().unwrap().ends_with('a'));
    }

    #[tokio::test]
    async fn a_helper_left_holding_stdout_does_not_hold_the_attempt() {
        let attempt = sh("sleep 60 & echo '{\"done\": true}'", serde_json::json!({}));
        let result = tokio::time::timeout(Duration::from_secs(20), attempt)
            .await
            .expect("the attempt ends when its command does")
            .unwrap();
        assert_eq!(result["done"], true);
    }

    #[tokio::test]
    async fn output_is_bounded() {
        let err = sh("head -c 8000000 /dev/zero", serde_json::json!({}))
            .await
            .unwrap_err();
        assert!(err.contains("more than"), "{err}");
        let err = sh(
            "head -c 8000000 /dev/zero | tr '\\0' e >&2; exit 3",
            serde_json::json!({}),
        )
        .await
        .unwrap_err();
        assert!(
            err.contains("exit status: 3") && err.len() < 4096,
            "{}",
            err.len()
        );
    }
}
