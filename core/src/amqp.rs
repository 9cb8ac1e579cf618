//! The AMQP layer: every connection, topology and publish/consume call Conveyor makes.
//!
//! Per task type T there are three quorum queues: `conveyor.T` (work), `conveyor.T.retry`
//! (per-message TTL, dead-letters back to the work queue) and `conveyor.T.remediation`
//! (parked tasks, and the work queue's dead letters). Messages are published to the type's
//! own direct exchange, `conveyor.T` (exchanges and queues are named apart), where each
//! queue is bound by its name: RabbitMQ authorizes a publish by exchange, so a tenant's
//! broker user, which may write only `conveyor.<namespace>.` exchanges, cannot put a message
//! into another tenant's queue (decision 0013). The broker's own dead-lettering between a
//! type's queues goes through the default exchange, which no permission governs.
//! Publishes are persistent, `mandatory` and confirmed; a nack, a return (no such queue), a
//! missing exchange or a missing confirm is an error, and the channel is replaced on the
//! next publish.

use std::time::Duration;

use futures_util::future::join_all;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, Consumer, ExchangeKind};
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::Mutex;
use uuid::Uuid;

use crate::task::{Requeue, TaskMessage};
use crate::task_type::NamedTaskType;

#[derive(Debug, thiserror::Error)]
pub enum AmqpError {
    #[error("broker unavailable: {0}")]
    Unavailable(lapin::Error),
    /// The broker answered and refused the login or the vhost: the credentials are wrong,
    /// not the broker down.
    #[error("broker refused the login: {0}")]
    LoginRefused(lapin::Error),
    /// Connecting (TCP, TLS and the AMQP handshake) took longer than this.
    #[error("broker did not accept a connection within {0:?}")]
    ConnectTimeout(Duration),
    /// The URL's TLS settings cannot be used (its `cacertfile`).
    #[error("{0}")]
    Tls(String),
    #[error("queue {queue} does not exist (declare the task type first)")]
    NoQueue { queue: String },
    #[error("broker refused the publish (nack)")]
    Nacked,
    #[error("no publisher confirm within {0:?}")]
    ConfirmTimeout(Duration),
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
            AmqpError::Tls(_) => "tls_settings",
            AmqpError::LoginRefused(_) => "login_refused",
            AmqpError::NoQueue { .. } => "no_queue",
            AmqpError::Nacked => "nacked",
            AmqpError::ConfirmTimeout(_) => "confirm_timeout",
            AmqpError::Mismatch { .. } => "topology_mismatch",
            AmqpError::Encode(_) => "encode",
        }
    }
}

pub type AmqpResult<T> = Result<T, AmqpError>;

/// The three queue names of a task type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueNames {
    pub main: String,
    pub retry: String,
    pub remediation: String,
}

impl QueueNames {
    pub fn of(task_type: &str) -> Self {
        let main = format!("conveyor.{task_type}");
        QueueNames {
            retry: format!("{main}.retry"),
            remediation: format!("{main}.remediation"),
            main,
        }
    }

    /// The type's exchange, named as its work queue: every queue of the type is bound to it
    /// by its own name.
    pub fn exchange(&self) -> &str {
        &self.main
    }

    pub fn route(&self, route: Requeue) -> &str {
        match route {
            Requeue::Main => &self.main,
            Requeue::Retry => &self.retry,
            Requeue::Remediation => &self.remediation,
        }
    }

    /// Retry queue `tier` (see [`NamedTaskType::retry_tiers`]): the first keeps the name
    /// `conveyor.T.retry`, the others are `conveyor.T.retry.<tier>`.
    pub fn retry_tier(&self, tier: u32) -> String {
        match tier {
            0 => self.retry.clone(),
            n => format!("{}.{n}", self.retry),
        }
    }

    /// Every retry queue a type with `tiers` of them has.
    pub fn retry_queues(&self, tiers: u32) -> Vec<String> {
        (0..tiers.max(1)).map(|t| self.retry_tier(t)).collect()
    }

    /// Every queue of a type with `tiers` retry queues.
    pub fn all(&self, tiers: u32) -> Vec<String> {
        let mut all = vec![self.main.clone()];
        all.extend(self.retry_queues(tiers));
        all.push(self.remediation.clone());
        all
    }
}

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

fn arg_str(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value))
}

/// The arguments of each queue, fixed at declaration. Settings that may change later
/// (the delivery limit, TTL caps, lengths) are policies, which the operator manages:
/// a queue argument would win over a policy and could never be changed.
pub fn queue_arguments(names: &QueueNames, retry_tiers: u32) -> Vec<(String, FieldTable)> {
    let quorum = || {
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), arg_str("quorum"));
        args
    };
    let mut main = quorum();
    main.insert("x-dead-letter-exchange".into(), arg_str(""));
    main.insert(
        "x-dead-letter-routing-key".into(),
        arg_str(&names.remediation),
    );
    let mut retry = quorum();
    retry.insert("x-dead-letter-exchange".into(), arg_str(""));
    retry.insert("x-dead-letter-routing-key".into(), arg_str(&names.main));
    // Expired retries must reach the work queue even across a broker crash.
    retry.insert("x-dead-letter-strategy".into(), arg_str("at-least-once"));
    retry.insert("x-overflow".into(), arg_str("reject-publish"));
    let mut queues = vec![(names.main.clone(), main)];
    for queue in names.retry_queues(retry_tiers) {
        queues.push((queue, retry.clone()));
    }
    queues.push((names.remediation.clone(), quorum()));
    queues
}

/// Declares a task type's queues (work, its retry queues, remediation), its exchange, and
/// each queue's binding to it. Idempotent; a queue that exists with other arguments is
/// reported as [`AmqpError::Mismatch`] (and closes the channel).
pub async fn declare_task_type(channel: &Channel, spec: &NamedTaskType) -> AmqpResult<()> {
    let names = QueueNames::of(&spec.name);
    let durable = || QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let exchange = names.exchange();
    let exchange_options = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    channel
        .exchange_declare(
            exchange,
            ExchangeKind::Direct,
            exchange_options,
            FieldTable::default(),
        )
        .await
        .map_err(AmqpError::Unavailable)?;
    for (queue, args) in queue_arguments(&names, spec.retry_tiers()) {
        channel
            .queue_declare(&queue, durable(), args)
            .await
            .map_err(|source| match &source {
                lapin::Error::ProtocolError(e) if e.get_id() == 406 => AmqpError::Mismatch {
                    queue: queue.clone(),
                    source,
                },
                _ => AmqpError::Unavailable(source),
            })?;
        channel
            .queue_bind(
                &queue,
                exchange,
                &queue,
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(AmqpError::Unavailable)?;
    }
    Ok(())
}

/// Ready messages in a queue, read with a passive declare. A missing queue is `NoQueue`.
pub async fn ready_count(channel: &Channel, queue: &str) -> AmqpResult<u32> {
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue, options, FieldTable::default())
        .await
        .map(|q| q.message_count())
        .map_err(|source| match &source {
            lapin::Error::ProtocolError(e) if e.get_id() == 404 => AmqpError::NoQueue {
                queue: queue.to_owned(),
            },
            _ => AmqpError::Unavailable(source),
        })
}

/// A message to publish: the task, where it goes, and for a retry queue which one and how
/// long it waits there.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub message: TaskMessage,
    pub route: Requeue,
    pub delay: Option<Duration>,
    /// For [`Requeue::Retry`]: the retry queue ([`NamedTaskType::retry_tier`]).
    pub retry_tier: u32,
}

/// One lazily (re)opened connection and channel, counted so that tests and metrics can
/// tell a reconnect from a reused link.
struct Link {
    url: String,
    name: String,
    confirms: bool,
    slot: Mutex<Option<(Connection, Channel)>>,
    connects: AtomicU64,
}

impl Link {
    fn new(url: String, name: String, confirms: bool) -> Self {
        Link {
            url,
            name,
            confirms,
            slot: Mutex::new(None),
            connects: AtomicU64::new(0),
        }
    }

    /// The channel, reconnecting when the connection was lost, and opening a new channel
    /// on the same connection when only the channel was closed (a 404 or 406 closes it).
    async fn channel(&self) -> AmqpResult<Channel> {
        let mut slot = self.slot.lock().await;
        if let Some((conn, channel)) = slot.as_mut() {
            if conn.status().connected() {
                if channel.status().connected() {
                    return Ok(channel.clone());
                }
                let fresh = self.open_channel(conn).await?;
                *channel = fresh.clone();
                return Ok(fresh);
            }
        }
        *slot = None;
        let conn = connect(&self.url, &self.name).await?;
        self.connects.fetch_add(1, Ordering::Relaxed);
        let channel = self.open_channel(&conn).await?;
        *slot = Some((conn, channel.clone()));
        Ok(channel)
    }

    async fn open_channel(&self, conn: &Connection) -> AmqpResult<Channel> {
        let channel = conn
            .create_channel()
            .await
            .map_err(AmqpError::Unavailable)?;
        if self.confirms {
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .map_err(AmqpError::Unavailable)?;
        }
        Ok(channel)
    }

    /// Drops the connection so that the next call starts afresh.
    async fn reset(&self) {
        if let Some((conn, _)) = self.slot.lock().await.take() {
            let _ = conn.close(0, "resetting the link").await;
        }
    }
}

/// A confirmed publisher over one lazily (re)opened connection.
pub struct Publisher {
    link: Link,
    confirm_timeout: Duration,
}

impl Publisher {
    /// `name` is the connection name the broker shows.
    pub fn new(url: impl Into<String>, name: impl Into<String>, confirm_timeout: Duration) -> Self {
        Publisher {
            link: Link::new(url.into(), name.into(), true),
            confirm_timeout,
        }
    }

    /// Connections opened so far (1 for a publisher that never lost its link).
    pub fn connections_opened(&self) -> u64 {
        self.link.connects.load(Ordering::Relaxed)
    }

    async fn channel(&self) -> AmqpResult<Channel> {
        self.link.channel().await
    }

    async fn reset(&self) {
        self.link.reset().await
    }

    /// Declares a task type's queues on the publisher's connection.
    pub async fn declare_task_type(&self, spec: &NamedTaskType) -> AmqpResult<()> {
        let channel = self.channel().await?;
        let result = declare_task_type(&channel, spec).await;
        if matches!(
            result,
            Err(AmqpError::Unavailable(_) | AmqpError::ConnectTimeout(_))
        ) {
            self.reset().await;
        }
        result
    }

    /// Publishes a probe (decision 0011) to `task_type`'s work queue and waits for its
    /// confirm. A worker that takes it off the queue reports it seen.
    pub async fn publish_probe(&self, task_type: &str, id: Uuid) -> AmqpResult<()> {
        let channel = self.channel().await?;
        let names = QueueNames::of(task_type);
        let body =
            serde_json::to_vec(&serde_json::json!({ "probe": id })).map_err(AmqpError::Encode)?;
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_type(ShortString::from(PROBE_KIND))
            .with_message_id(ShortString::from(id.to_string()));
        let result = self
            .confirmed(&channel, names.exchange(), &names.main, &body, properties)
            .await;
        // A missing exchange closes the channel, too.
        if matches!(
            result,
            Err(AmqpError::Unavailable(_)
                | AmqpError::ConnectTimeout(_)
                | AmqpError::ConfirmTimeout(_)
                | AmqpError::NoQueue { .. })
        ) {
            self.reset().await;
        }
        result
    }

    /// Publishes every message, pipelined, and returns once the broker confirmed each one.
    /// The result per message is in input order; any failure also resets the channel.
    pub async fn publish(&self, batch: &[Outgoing]) -> Vec<AmqpResult<()>> {
        let channel = match self.channel().await {
            Ok(channel) => channel,
            Err(err) => return batch.iter().map(|_| Err(clone_error(&err))).collect(),
        };
        let sends = batch.iter().map(|out| self.publish_one(&channel, out));
        let results = join_all(sends).await;
        if results.iter().any(|r| {
            matches!(
                r,
                Err(AmqpError::Unavailable(_) | AmqpError::ConfirmTimeout(_))
            )
        }) {
            self.reset().await;
        }
        results
    }

    async fn publish_one(&self, channel: &Channel, out: &Outgoing) -> AmqpResult<()> {
        let names = QueueNames::of(&out.message.task_type);
        let queue = match out.route {
            Requeue::Retry => names.retry_tier(out.retry_tier),
            route => names.route(route).to_owned(),
        };
        let queue = queue.as_str();
        let body = serde_json::to_vec(&out.message).map_err(AmqpError::Encode)?;
        let mut properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type(ShortString::from("application/json"))
            .with_message_id(ShortString::from(out.message.id.to_string()));
        if let Some(delay) = out.delay {
            // Per-message TTL: the retry queue dead-letters it to the work queue on expiry.
            properties =
                properties.with_expiration(ShortString::from(delay.as_millis().to_string()));
        }
        self.confirmed(channel, names.exchange(), queue, &body, properties)
            .await
    }

    /// One mandatory publish through `exchange` to `queue`, confirmed within the confirm
    /// timeout.
    async fn confirmed(
        &self,
        channel: &Channel,
        exchange: &str,
        queue: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> AmqpResult<()> {
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let confirm = async {
            channel
                .basic_publish(exchange, queue, options, body, properties)
                .await?
                .await
        };
        match tokio::time::timeout(self.confirm_timeout, confirm).await {
            Err(_) => Err(AmqpError::ConfirmTimeout(self.confirm_timeout)),
            // No such exchange: the type is not declared (or was deleted), as for a return.
            Ok(Err(lapin::Error::ProtocolError(e))) if e.get_id() == 404 => {
                Err(AmqpError::NoQueue {
                    queue: queue.to_owned(),
                })
            }
            Ok(Err(err)) => Err(AmqpError::Unavailable(err)),
            Ok(Ok(Confirmation::Ack(None))) => Ok(()),
            Ok(Ok(Confirmation::Ack(Some(_returned)))) => Err(AmqpError::NoQueue {
                queue: queue.to_owned(),
            }),
            Ok(Ok(Confirmation::Nack(_))) => Err(AmqpError::Nacked),
            Ok(Ok(Confirmation::NotRequested)) => Err(AmqpError::Nacked),
        }
    }
}

/// Reads queue depths on a connection of its own, never the publisher's: a depth poll or
/// readiness probe on a queue that does not exist (a TaskType being created or deleted)
/// closes only this channel, which is reopened on the same connection.
pub struct QueueObserver {
    link: Link,
}

impl QueueObserver {
    pub fn new(url: impl Into<String>, name: impl Into<String>) -> Self {
        QueueObserver {
            link: Link::new(url.into(), name.into(), false),
        }
    }

    /// Ready messages in a queue; a missing queue is [`AmqpError::NoQueue`].
    pub async fn ready_count(&self, queue: &str) -> AmqpResult<u32> {
        let channel = self.link.channel().await?;
        let result = ready_count(&channel, queue).await;
        if matches!(
            result,
            Err(AmqpError::Unavailable(_) | AmqpError::ConnectTimeout(_))
        ) {
            self.link.reset().await;
        }
        result
    }
}

/// The message type of a probe (decision 0011); task messages carry none.
pub const PROBE_KIND: &str = "conveyor.probe";

/// The probe id, if `delivery` is a probe rather than a task.
pub fn probe_id(delivery: &lapin::message::Delivery) -> Option<Uuid> {
    let kind = delivery.properties.kind().as_ref()?;
    if kind.as_str() != PROBE_KIND {
        return None;
    }
    #[derive(serde::Deserialize)]
    struct Probe {
        probe: Uuid,
    }
    serde_json::from_slice::<Probe>(&delivery.data)
        .ok()
        .map(|p| p.probe)
}

/// lapin's errors are not `Clone`; a failed connect is reported once per message.
fn clone_error(err: &AmqpError) -> AmqpError {
    match err {
        AmqpError::Unavailable(e) => AmqpError::Unavailable(e.clone()),
        AmqpError::LoginRefused(e) => AmqpError::LoginRefused(e.clone()),
        AmqpError::NoQueue { queue } => AmqpError::NoQueue {
            queue: queue.clone(),
        },
        AmqpError::Nacked => AmqpError::Nacked,
        AmqpError::ConfirmTimeout(d) => AmqpError::ConfirmTimeout(*d),
        AmqpError::ConnectTimeout(d) => AmqpError::ConnectTimeout(*d),
        AmqpError::Mismatch { queue, source } => AmqpError::Mismatch {
            queue: queue.clone(),
            source: source.clone(),
        },
        AmqpError::Encode(_) => AmqpError::Nacked,
        AmqpError::Tls(e) => AmqpError::Tls(e.clone()),
    }
}

/// A consuming channel on the work queues of some task types, prefetch = `prefetch`.
pub async fn consume(
    conn: &Connection,
    queues: &[String],
    prefetch: u16,
    tag: &str,
) -> AmqpResult<(Channel, Vec<Consumer>)> {
    let channel = conn
        .create_channel()
        .await
        .map_err(AmqpError::Unavailable)?;
    // global=false: the limit applies per consumer, as RabbitMQ interprets basic.qos.
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await
        .map_err(AmqpError::Unavailable)?;
    let mut consumers = Vec::with_capacity(queues.len());
    for queue in queues {
        let consumer = channel
            .basic_consume(
                queue,
                &format!("{tag}.{queue}"),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|source| match &source {
                lapin::Error::ProtocolError(e) if e.get_id() == 404 => AmqpError::NoQueue {
                    queue: queue.clone(),
                },
                _ => AmqpError::Unavailable(source),
            })?;
        consumers.push(consumer);
    }
    Ok((channel, consumers))
}

/// Whether `queue` exists: a passive declare, on a channel of its own (a missing queue
/// closes the channel). RabbitMQ answers it whatever the user's permissions, so `true`
/// does not mean the user may consume it.
pub async fn queue_exists(conn: &Connection, queue: &str) -> AmqpResult<bool> {
    let channel = conn
        .create_channel()
        .await
        .map_err(AmqpError::Unavailable)?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    match channel
        .queue_declare(queue, passive, FieldTable::default())
        .await
    {
        Ok(_) => Ok(true),
        Err(lapin::Error::ProtocolError(e)) if e.get_id() == 404 => Ok(false),
        Err(source) => Err(AmqpError::Unavailable(source)),
    }
}

/// Deletes queues and every message in them; a missing one is fine.
pub async fn delete_queues(conn: &Connection, queues: &[String]) {
    // A channel per queue: deleting one that is not there closes its channel.
    for queue in queues {
        if let Ok(channel) = conn.create_channel().await {
            let _ = channel.queue_delete(queue, Default::default()).await;
        }
    }
}

/// Deletes a type's exchange (its queues' bindings went with them); a missing one is fine.
pub async fn delete_exchange(conn: &Connection, names: &QueueNames) {
    if let Ok(channel) = conn.create_channel().await {
        let _ = channel
            .exchange_delete(names.exchange(), Default::default())
            .await;
    }
}

/// Takes one message from a queue without a consumer (`basic.get`), unacked.
pub async fn get_one(
    channel: &Channel,
    queue: &str,
) -> AmqpResult<Option<lapin::message::Delivery>> {
    channel
        .basic_get(queue, lapin::options::BasicGetOptions::default())
        .await
        .map(|message| message.map(|m| m.delivery))
        .map_err(|source| match &source {
            lapin::Error::ProtocolError(e) if e.get_id() == 404 => AmqpError::NoQueue {
                queue: queue.to_owned(),
            },
            _ => AmqpError::Unavailable(source),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn retry_queue_dead_letters_back_to_work_and_work_to_remediation() {
        let queues = queue_arguments(&QueueNames::of("t"), 1);
        let [(main, main_args), (retry, retry_args), (_, remediation_args)] = &queues[..] else {
            panic!("three queues: {queues:?}");
        };
        let (main_args, retry_args, remediation_args) = (
            main_args.clone(),
            retry_args.clone(),
            remediation_args.clone(),
        );
        assert_eq!(main, "conveyor.t");
        assert_eq!(retry, "conveyor.t.retry");
        let get = |args: &FieldTable, key: &str| args.inner().get(key).cloned();
        assert_eq!(
            get(&main_args, "x-dead-letter-routing-key"),
            Some(arg_str("conveyor.t.remediation"))
        );
        assert_eq!(
            get(&retry_args, "x-dead-letter-routing-key"),
            Some(arg_str("conveyor.t"))
        );
        assert_eq!(
            get(&retry_args, "x-dead-letter-strategy"),
            Some(arg_str("at-least-once"))
        );
        assert_eq!(
            get(&remediation_args, "x-queue-type"),
            Some(arg_str("quorum"))
        );
        assert_eq!(get(&remediation_args, "x-dead-letter-exchange"), None);
    }
}
