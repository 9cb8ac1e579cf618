//! Opening connections: heartbeats, TLS, a bounded connect, a refused login told apart.

use std::time::Duration;

use lapin::{Connection, ConnectionProperties};

use super::error::{AmqpError, AmqpResult};

/// Adds `heartbeat=<seconds>` to an AMQP URL that does not choose one (one that does not
/// parse is left for the client to report).
pub fn with_heartbeat(url: &str, seconds: u16) -> String {
    match crate::urls::query_param(url, "heartbeat") {
        Some(_) => url.to_owned(),
        None => crate::urls::with_params(url, &[("heartbeat", &seconds.to_string())])
            .unwrap_or_else(|_| url.to_owned()),
    }
}

/// Opens a connection driven by the tokio runtime. `name` shows in the broker's
/// connection list (and lets tests find and cut a given process's connection). An
/// `amqps://` URL is verified against its `cacertfile`, read anew on each connect. Bounded
/// by [`CONNECT_TIMEOUT`]: a broker that accepts TCP but never answers (or a dropped SYN)
/// must not hold a caller, or the link's lock, for the OS's minutes.
pub async fn connect(url: &str, name: &str) -> AmqpResult<Connection> {
    let properties = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio)
        .with_connection_name(name.into());
    let tls = lapin::tcp::OwnedTLSConfig {
        identity: None,
        cert_chain: crate::tls::amqp_ca(url).map_err(|e| AmqpError::Tls(e.to_string()))?,
    };
    match tokio::time::timeout(
        CONNECT_TIMEOUT,
        Connection::connect_with_config(url, properties, tls),
    )
    .await
    {
        Ok(connected) => connected.map_err(connect_error),
        Err(_) => Err(AmqpError::ConnectTimeout(CONNECT_TIMEOUT)),
    }
}

/// A refused login (403) or vhost (530) is the caller's settings; anything else an outage.
fn connect_error(err: lapin::Error) -> AmqpError {
    use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
    let refused = matches!(&err, lapin::Error::ProtocolError(e) if matches!(
        e.kind(),
        AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)
            | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)
    ));
    if refused {
        AmqpError::LoginRefused(err)
    } else {
        AmqpError::Unavailable(err)
    }
}

/// The longest a connection attempt may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

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
    }
}
