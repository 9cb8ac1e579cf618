//! Conveyor's shared library: the task model and lifecycle, task type settings, and the
//! Postgres and AMQP layers every binary uses.
#![forbid(unsafe_code)]

pub mod admin;
pub mod amqp;
pub mod config;
pub mod crd;
pub mod db;
pub mod lifecycle;
pub mod metrics;
pub mod policies;
pub mod requeue;
pub mod task;
pub mod task_type;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tls;
pub mod upkeep;

pub use lifecycle::TaskState;

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
