//! Task handlers: what a worker runs for each task.

mod exec;
mod progress_file;

use std::time::Duration;

use conveyor_core::task::TaskMessage;

use crate::progress::ProgressSink;

/// How a worker pool processes its tasks.
#[derive(Debug, Clone)]
pub enum Handler {
    /// Runs a command per task: payload on stdin and in `CONVEYOR_PAYLOAD`; exit code 0 is
    /// success, and stdout (JSON if it parses, else text) is the result.
    Exec { command: String, args: Vec<String> },
    /// POSTs the payload to a sidecar; a 2xx answer is success and its body the result.
    Http {
        url: String,
        client: reqwest::Client,
    },
    /// Succeeds at once (benchmarks).
    Noop,
    /// Sleeps `sleepMs` from the payload (default 100), then succeeds.
    Sleep,
    /// Always fails (retry and dead-letter tests).
    Fail,
    /// Aborts the whole worker process (poison-message tests).
    Crash,
    /// Panics inside the worker (tests of what a bug in a handler leaves behind).
    Panic,
}

/// Why an attempt did not succeed.
pub type Failure = String;

impl Handler {
    /// `exec` is the command and its arguments.
    pub fn parse(name: &str, exec: &[String], http_url: Option<&str>) -> Result<Self, String> {
        Ok(match name {
            "noop" => Handler::Noop,
            "sleep" => Handler::Sleep,
            "fail" => Handler::Fail,
            "crash" => Handler::Crash,
            "panic" => Handler::Panic,
            "exec" => {
                let (command, args) = exec
                    .split_first()
                    .ok_or("the exec handler needs a command (--exec-command or after --)")?;
                Handler::Exec {
                    command: command.clone(),
                    args: args.to_vec(),
                }
            }
            "http" => Handler::Http {
                url: http_url
                    .ok_or("the http handler needs --http-url")?
                    .to_owned(),
                client: reqwest::Client::new(),
            },
            other => {
                return Err(format!(
                    "unknown handler {other:?} (exec, http, noop, sleep, fail, crash, panic)"
                ))
            }
        })
    }

    /// Runs one attempt. Dropping the future stops it (an exec child is killed).
    pub async fn run(
        &self,
        task: &TaskMessage,
        progress: &ProgressSink,
    ) -> Result<serde_json::Value, Failure> {
        match self {
            Handler::Noop => Ok(serde_json::json!({})),
            Handler::Sleep => {
                let ms = task
                    .payload
                    .get("sleepMs")
                    .and_then(|v| v.as_u64())
                    .unwrap_or(100);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok(serde_json::json!({ "sleptMs": ms }))
            }
            Handler::Fail => Err("the fail handler always fails".to_owned()),
            Handler::Crash => {
                tracing::error!(task = %task.id, "crash handler: aborting the worker");
                std::process::abort()
            }
            Handler::Panic => panic!("the panic handler panics (task {})", task.id),
            Handler::Exec { command, args } => exec::run(command, args, task, progress).await,
            Handler::Http { url, client } => run_http(client, url, task, progress).await,
        }
    }
}

async fn run_http(
    client: &reqwest::Client,
    url: &str,
    task: &TaskMessage,
    progress: &ProgressSink,
) -> Result<serde_json::Value, Failure> {
    let mut request = client.post(url);
    if let Some(callback) = progress.callback_url() {
        request = request.header("X-Conveyor-Progress-Url", callback);
    }
    if let Some(traceparent) = &task.traceparent {
        request = request.header("traceparent", traceparent);
    }
    let response = request
        .header("X-Conveyor-Task-Id", task.id.to_string())
        .header("X-Conveyor-Task-Type", &task.task_type)
        .header("X-Conveyor-Attempt", task.attempt.to_string())
        .header("Idempotency-Key", task.idempotency_key.to_string())
        .json(&task.payload)
        .send()
        .await
        .map_err(|e| format!("POST {url}: {e}"))?;
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    if status.is_success() {
        Ok(serde_json::from_str(&body)
            .unwrap_or_else(|_| serde_json::json!({ "body": tail(&body) })))
    } else {
        Err(format!("POST {url} answered {status}: {}", tail(&body)))
    }
}

/// The last 2 KiB of a command's output: enough to diagnose, small enough for the audit log.
fn tail(text: &str) -> String {
    const MAX: usize = 2048;
    let text = text.trim();
    if text.len() <= MAX {
        return text.to_owned();
    }
    let mut start = text.len() - MAX;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("…{}", &text[start..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use uuid::Uuid;

    fn task(payload: serde_json::Value) -> TaskMessage {
        TaskMessage {
            id: Uuid::new_v4(),
            task_type: "t".into(),
            attempt: 0,
            idempotency_key: Uuid::new_v4(),
            payload,
            submitted_at: Utc::now(),
            suspect: false,
            traceparent: None,
        }
    }

    fn words(line: &str) -> Vec<String> {
        line.split_whitespace().map(str::to_owned).collect()
    }

    #[tokio::test]
    async fn exec_success_failure_and_environment() {
        let echo = Handler::parse("exec", &words("sh -c cat"), None).unwrap();
        let result = echo
            .run(
                &task(serde_json::json!({"a": 1})),
                &ProgressSink::detached(),
            )
            .await
            .unwrap();
        assert_eq!(result, serde_json::json!({"a": 1}));

        let env = Handler::parse("exec", &words("sh -c echo$IFS$CONVEYOR_ATTEMPT"), None).unwrap();
        assert_eq!(
            env.run(&task(serde_json::json!({})), &ProgressSink::detached())
                .await
                .unwrap(),
            serde_json::json!(0)
        );

        let fail = Handler::parse("exec", &words("false"), None).unwrap();
        let err = fail
            .run(&task(serde_json::json!({})), &ProgressSink::detached())
            .await
            .unwrap_err();
        assert!(err.contains("exit status: 1"), "{err}");

        let missing = Handler::parse("exec", &words("/nonexistent/tool"), None).unwrap();
        assert!(missing
            .run(&task(serde_json::json!({})), &ProgressSink::detached())
            .await
            .unwrap_err()
            .contains("cannot start"));
    }

    #[test]
    fn unknown_handlers_are_refused() {
        assert!(Handler::parse("teleport", &[], None).is_err());
        assert!(Handler::parse("exec", &[], None).is_err());
    }
}
