//! A broker setting names one node or several: URLs separated by commas, one per node of a
//! RabbitMQ cluster. Each connect tries them in turn, starting with the one that last worked
//! in this process, so that clients move to a surviving node when theirs dies.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lapin::{Connection, ConnectionProperties};

use super::error::{AmqpError, AmqpResult};

/// The URLs of a broker setting: one per node, in the order given (blanks ignored).
pub fn node_urls(setting: &str) -> Vec<&str> {
    setting
        .split(',')
        .map(str::trim)
        .filter(|url| !url.is_empty())
        .collect()
}

/// Adds `heartbeat=<seconds>` to each node URL that does not choose one (one that does not
/// parse is left for the client to report).
pub fn with_heartbeat(setting: &str, seconds: u16) -> String {
    let seconds = seconds.to_string();
    node_urls(setting)
        .into_iter()
        .map(|url| match crate::urls::query_param(url, "heartbeat") {
            Some(_) => url.to_owned(),
            None => crate::urls::with_params(url, &[("heartbeat", &seconds)])
                .unwrap_or_else(|_| url.to_owned()),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The node this process last connected to, as an index into its setting's node list.
/// Seeded at random (not from the process id, which is 1 in every container), so that a
/// fleet's connections spread over the nodes.
static LAST_GOOD: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Opens a connection driven by the tokio runtime, to the first node of `setting` that
/// accepts one, starting from the node that last did. `name` shows in the broker's
/// connection list (and lets tests find and cut a given process's connection). An
/// `amqps://` URL is verified against its `cacertfile`, read anew on each connect. Each node
/// gets its share of [`CONNECT_TIMEOUT`] but at least [`NODE_CONNECT_TIMEOUT`] (so a search
/// over more than three nodes can take longer), so that a node that accepts TCP but never
/// answers (paused, cut off) costs only its share. A refused login or unusable TLS settings end the search: every
/// node of a cluster shares its users, so the next would refuse them too.
pub async fn connect(setting: &str, name: &str) -> AmqpResult<Connection> {
    let nodes = node_urls(setting);
    if nodes.is_empty() {
        return Err(AmqpError::NoUrl);
    }
    let mut start = LAST_GOOD.load(Ordering::Relaxed);
    if start == usize::MAX {
        start = rand::random::<u32>() as usize;
    }
    let each = (CONNECT_TIMEOUT / nodes.len() as u32).max(NODE_CONNECT_TIMEOUT);
    let mut last_error = None;
    for k in 0..nodes.len() {
        let i = (start + k) % nodes.len();
        match connect_node(nodes[i], name, each).await {
            Ok(conn) => {
                LAST_GOOD.store(i, Ordering::Relaxed);
                return Ok(conn);
            }
            Err(
                err @ (AmqpError::LoginRefused(_) | AmqpError::Tls(_) | AmqpError::Certificate(_)),
            ) => return Err(err),
            Err(err) => {
                if nodes.len() > 1 {
                    tracing::warn!(node = i, error = %err, "broker node unreachable, trying the next");
                }
                last_error = Some(err);
            }
        }
    }
    Err(last_error.expect("at least one node was tried"))
}

/// One node, bounded by `timeout`: a broker that accepts TCP but never answers (a paused
/// node, a dropped SYN) must not hold a caller, or the link's lock, for the OS's minutes.
async fn connect_node(url: &str, name: &str, timeout: Duration) -> AmqpResult<Connection> {
    let properties = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio)
        .with_connection_name(name.into());
    let tls = lapin::tcp::OwnedTLSConfig {
        identity: None,
        cert_chain: crate::tls::amqp_ca(url).map_err(|e| AmqpError::Tls(e.to_string()))?,
    };
    match tokio::time::timeout(
        timeout,
        Connection::connect_with_config(url, properties, tls),
    )
    .await
    {
        Ok(connected) => connected.map_err(connect_error),
        Err(_) => Err(AmqpError::ConnectTimeout(timeout)),
    }
}

/// Closes `conn`, waiting at most [`CLOSE_TIMEOUT`] for the broker's close-ok: a node that
/// stopped answering (paused, cut off) never sends it, and a caller waiting for it would
/// wait for the heartbeat to give up.
pub async fn close_bounded(conn: &Connection, code: u16, reason: &str) {
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, conn.close(code, reason)).await;
}

/// A refused login (403) or vhost (530), or a refused certificate, is the caller's settings;
/// anything else an outage.
fn connect_error(err: lapin::Error) -> AmqpError {
    use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
    let refused = matches!(&err, lapin::Error::ProtocolError(e) if matches!(
        e.kind(),
        AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)
            | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)
    ));
    if refused {
        AmqpError::LoginRefused(err)
    } else if crate::refused_certificate(&err) {
        AmqpError::Certificate(err)
    } else {
        AmqpError::Unavailable(err)
    }
}

/// The longest a connection attempt may take (to a single node, or shared by a cluster's).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest a close waits for the broker to confirm it.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);
/// The least each node of a cluster gets: a TLS handshake on a busy node takes a while.
pub const NODE_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::QueueNames;
    use crate::task::Requeue;

    #[test]
    fn queue_names_and_heartbeat_urls() {
        let names = QueueNames::of("transcode");
        assert_eq!(names.route(Requeue::Main), "conveyor.transcode");
        assert_eq!(names.route(Requeue::Retry), "conveyor.transcode.retry");
        assert_eq!(
            names.route(Requeue::Remediation),
            "conveyor.transcode.remediation"
        );
        assert_eq!(
            with_heartbeat("amqp://h/%2f", 5),
            "amqp://h/%2f?heartbeat=5"
        );
        assert_eq!(
            with_heartbeat("amqp://h/?x=1", 5),
            "amqp://h/?x=1&heartbeat=5"
        );
        assert_eq!(
            with_heartbeat("amqp://h/?heartbeat=3", 5),
            "amqp://h/?heartbeat=3"
        );
        assert_eq!(
            with_heartbeat("amqp://a/%2f?x=1, amqp://b/%2f?heartbeat=3,", 5),
            "amqp://a/%2f?x=1&heartbeat=5,amqp://b/%2f?heartbeat=3"
        );
        assert_eq!(node_urls(" amqp://a ,,amqp://b"), ["amqp://a", "amqp://b"]);
    }
}
