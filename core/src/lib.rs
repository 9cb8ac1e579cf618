//! Conveyor's shared library: the task model and lifecycle, task type settings, and the
//! Postgres and AMQP layers every binary uses.
#![forbid(unsafe_code)]

pub mod admin;
pub mod amqp;
pub mod batch;
pub mod config;
pub mod crd;
pub mod db;
pub mod drain;
pub mod jsonb;
pub mod labels;
pub mod lifecycle;
pub mod metrics;
pub mod plaintext;
pub mod policies;
pub mod remediation;
pub mod requeue;
pub mod secrets;
pub mod task;
pub mod task_type;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tls;
pub mod trace;
pub mod upkeep;
pub mod urls;
#[cfg(feature = "cluster")]
pub mod watch_scope;

pub use lifecycle::TaskState;

/// An error and every cause under it, on one line: some libraries (reqwest) leave the reason
/// (a refused connection, an unknown certificate issuer) to their sources, which a log line
/// of the error alone does not print. A cause the text already says (errors that repeat
/// their source in their own message, for log lines that print no chain) is said once.
pub fn with_causes(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(inner) = cause {
        let said = inner.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        cause = inner.source();
    }
    text
}

/// Whether `err` failed on a peer's certificate (rustls says "invalid peer certificate"): a
/// CA setting that does not match the server, a setting to fix rather than an outage.
pub fn refused_certificate(err: &(dyn std::error::Error + 'static)) -> bool {
    with_causes(err).contains("invalid peer certificate")
}

/// Cancels `token` on SIGTERM or Ctrl-C; the binaries' one shutdown input.
pub async fn shutdown_on_signals(token: tokio_util::sync::CancellationToken) {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(err) => {
            tracing::error!(error = %err, "cannot listen for SIGTERM");
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => tracing::info!("interrupt: shutting down"),
    }
    token.cancel();
}
