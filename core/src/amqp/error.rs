//! What an AMQP call can fail with, and the category each counts as.

use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum AmqpError {
    /// The cause is in the message too: many log lines print an error without its chain.
    #[error("broker unavailable: {0}")]
    Unavailable(#[source] lapin::Error),
    /// The broker answered and refused the login or the vhost: the credentials are wrong,
    /// not the broker down.
    #[error("broker refused the login: {0}")]
    LoginRefused(#[source] lapin::Error),
    /// Connecting (TCP, TLS and the AMQP handshake) took longer than this.
    #[error("broker did not accept a connection within {0:?}")]
    ConnectTimeout(Duration),
    /// The URL's TLS settings cannot be used (its `cacertfile`).
    #[error("{0}")]
    Tls(String),
    /// The broker's certificate was refused: the CA given does not match the broker's.
    #[error("broker's certificate refused (check the CA setting): {0}")]
    Certificate(#[source] lapin::Error),
    /// The broker setting names no node.
    #[error("no broker URL given")]
    NoUrl,
    #[error("queue {queue} does not exist (declare the task type first)")]
    NoQueue { queue: String },
    #[error("broker refused the publish (nack)")]
    Nacked,
    #[error("no publisher confirm within {0:?}")]
    ConfirmTimeout(Duration),
    /// The broker took longer than this to declare a task type's queues: hung, or too
    /// busy to answer (quorum queues are slow to create on a loaded node).
    #[error("broker did not declare the queues within {0:?}")]
    DeclareTimeout(Duration),
    #[error("queue {queue} exists with different arguments")]
    Mismatch {
        queue: String,
        #[source]
        source: lapin::Error,
    },
    #[error("cannot encode task message")]
    Encode(#[source] serde_json::Error),
}

impl AmqpError {
    /// Stable label for metrics and logs.
    pub fn category(&self) -> &'static str {
        match self {
            AmqpError::Unavailable(_) | AmqpError::ConnectTimeout(_) => "unavailable",
            AmqpError::Tls(_) | AmqpError::Certificate(_) => "tls_settings",
            AmqpError::NoUrl => "no_url",
            AmqpError::LoginRefused(_) => "login_refused",
            AmqpError::NoQueue { .. } => "no_queue",
            AmqpError::Nacked => "nacked",
            AmqpError::ConfirmTimeout(_) => "confirm_timeout",
            AmqpError::DeclareTimeout(_) => "declare_timeout",
            AmqpError::Mismatch { .. } => "topology_mismatch",
            AmqpError::Encode(_) => "encode",
        }
    }
}

pub type AmqpResult<T> = Result<T, AmqpError>;

/// lapin's errors are not `Clone`; a failed connect is reported once per message.
pub(super) fn clone_error(err: &AmqpError) -> AmqpError {
    match err {
        AmqpError::Unavailable(e) => AmqpError::Unavailable(e.clone()),
        AmqpError::LoginRefused(e) => AmqpError::LoginRefused(e.clone()),
        AmqpError::NoQueue { queue } => AmqpError::NoQueue {
            queue: queue.clone(),
        },
        AmqpError::Nacked => AmqpError::Nacked,
        AmqpError::ConfirmTimeout(d) => AmqpError::ConfirmTimeout(*d),
        AmqpError::DeclareTimeout(d) => AmqpError::DeclareTimeout(*d),
        AmqpError::ConnectTimeout(d) => AmqpError::ConnectTimeout(*d),
        AmqpError::Mismatch { queue, source } => AmqpError::Mismatch {
            queue: queue.clone(),
            source: source.clone(),
        },
        AmqpError::Encode(_) => AmqpError::Nacked,
        AmqpError::Tls(e) => AmqpError::Tls(e.clone()),
        AmqpError::Certificate(e) => AmqpError::Certificate(e.clone()),
        AmqpError::NoUrl => AmqpError::NoUrl,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn a_wrapped_broker_error_keeps_its_cause_and_says_it_once() {
        let err = AmqpError::Unavailable(lapin::Error::InvalidChannel(7));
        assert!(err.source().is_some(), "the cause is the source");
        let text = crate::with_causes(&err);
        let cause = err.source().unwrap().to_string();
        assert_eq!(text.matches(&cause).count(), 1, "{text}");
    }
}
