//! Confirmed publishing over a link that reconnects, and a queue observer.

use std::time::Duration;

use futures_util::future::join_all;
use lapin::options::ConfirmSelectOptions;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::Mutex;
use uuid::Uuid;

use super::confirms::{Confirmed, Confirms, LastConfirm, Message};
use super::connection::{close_bounded, connect};
use super::consume::PROBE_KIND;
use super::error::{clone_error, AmqpError, AmqpResult};
use super::names::QueueNames;
use super::topology::{declare_task_type, queue_counts, ready_count, QueueCounts};
use crate::task::{Requeue, TaskMessage};
use crate::task_type::NamedTaskType;

/// The message header that carries a task's W3C trace context.
pub const TRACEPARENT_HEADER: &str = "traceparent";

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

/// One lazily (re)opened connection and its shared channels, counted so that tests and
/// metrics can tell a reconnect from a reused link.
struct Link {
    url: String,
    name: String,
    confirms: bool,
    /// Shared channels on the connection. The broker runs each channel in one process, one
    /// method after another: a publisher's confirms are spread over several to use more
    /// than one of the broker's cores.
    width: usize,
    slot: Mutex<Option<Open>>,
    connects: AtomicU64,
    /// When any of its channels last had a confirm completed.
    last_confirm: Arc<LastConfirm>,
}

struct Open {
    conn: Connection,
    channels: Vec<Shared>,
}

/// A shared channel, and in confirm mode its confirm reader.
#[derive(Clone)]
struct Shared {
    channel: Channel,
    confirms: Option<Confirms>,
}

impl Link {
    fn new(url: String, name: String, confirms: bool, width: usize) -> Self {
        Link {
            url,
            name,
            confirms,
            width: width.max(1),
            slot: Mutex::new(None),
            connects: AtomicU64::new(0),
            last_confirm: Arc::default(),
        }
    }

    /// The first shared channel (see [`Link::channels`]).
    async fn channel(&self) -> AmqpResult<Shared> {
        let mut channels = self.channels().await?;
        Ok(channels.swap_remove(0))
    }

    /// The shared channels, reconnecting when the connection was lost, and opening a new
    /// channel on the same connection for one that was closed (a 404 or 406 closes it).
    async fn channels(&self) -> AmqpResult<Vec<Shared>> {
        let mut slot = self.slot.lock().await;
        let open = self.connected(&mut slot).await?;
        for shared in &mut open.channels {
            if !shared.channel.status().connected() {
                *shared = self.open_channel(&open.conn).await?;
            }
        }
        Ok(open.channels.clone())
    }

    /// A plain channel of its own on the link's connection (reconnecting when it was lost):
    /// the broker runs each channel's methods one after another, so work that may be slow
    /// must not queue behind the shared channel, nor leave a late answer on it.
    async fn own_channel(&self) -> AmqpResult<Channel> {
        let mut slot = self.slot.lock().await;
        let open = self.connected(&mut slot).await?;
        open.conn
            .create_channel()
            .await
            .map_err(AmqpError::Unavailable)
    }

    /// The open connection and its shared channels, connecting afresh when it was lost.
    async fn connected<'a>(&self, slot: &'a mut Option<Open>) -> AmqpResult<&'a mut Open> {
        if !slot
            .as_ref()
            .is_some_and(|open| open.conn.status().connected())
        {
            *slot = None;
            let conn = connect(&self.url, &self.name).await?;
            self.connects.fetch_add(1, Ordering::Relaxed);
            let mut channels = Vec::with_capacity(self.width);
            for _ in 0..self.width {
                channels.push(self.open_channel(&conn).await?);
            }
            *slot = Some(Open { conn, channels });
        }
        Ok(slot.as_mut().expect("connected just above"))
    }

    async fn open_channel(&self, conn: &Connection) -> AmqpResult<Shared> {
        let channel = conn
            .create_channel()
            .await
            .map_err(AmqpError::Unavailable)?;
        if !self.confirms {
            return Ok(Shared {
                channel,
                confirms: None,
            });
        }
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(AmqpError::Unavailable)?;
        Ok(Shared {
            confirms: Some(Confirms::start(channel.clone(), self.last_confirm.clone())),
            channel,
        })
    }

    /// Whether the link's connection is open now.
    async fn is_open(&self) -> bool {
        self.slot
            .lock()
            .await
            .as_ref()
            .is_some_and(|open| open.conn.status().connected())
    }

    /// Drops the connection so that the next call starts afresh (the close is bounded:
    /// every publish behind this link waits for it).
    async fn reset(&self) {
        if let Some(open) = self.slot.lock().await.take() {
            close_bounded(&open.conn, 0, "resetting the link").await;
        }
    }
}

/// Which exchange a [`Publisher`] sends through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The type's own exchange: all that a tenant's broker user may write (decision 0013).
    TypeExchange,
    /// The default exchange, by queue name: for the components that serve every tenant
    /// (their users write `amq.default`, decision 0015). It cannot be missing, so no type's
    /// state can close a channel that other tenants' publishes share; a missing queue is a
    /// return, which fails only its own message (decision 0045).
    DefaultExchange,
}

/// A confirmed publisher over one lazily (re)opened connection.
pub struct Publisher {
    link: Link,
    via: Via,
    confirm_timeout: Duration,
    /// Where the next batch starts among the channels, so that small batches spread too.
    turn: AtomicUsize,
}

/// `--publish-channels` unless told otherwise: with four, batch submits ran about a tenth
/// faster than with one in `make bench` (decision 0026), single submits the same within
/// the noise.
pub const DEFAULT_PUBLISH_CHANNELS: usize = 4;

impl Publisher {
    /// `name` is the connection name the broker shows. One publishing channel: for a
    /// publisher that sends little (the operator's declarations use channels of their own).
    pub fn new(url: impl Into<String>, name: impl Into<String>, confirm_timeout: Duration) -> Self {
        Self::with_channels(url, name, confirm_timeout, 1)
    }

    /// A publisher whose batches are spread over `channels` confirm-mode channels (at
    /// least one) on its connection.
    pub fn with_channels(
        url: impl Into<String>,
        name: impl Into<String>,
        confirm_timeout: Duration,
        channels: usize,
    ) -> Self {
        Publisher {
            link: Link::new(url.into(), name.into(), true, channels),
            via: Via::TypeExchange,
            confirm_timeout,
            turn: AtomicUsize::new(0),
        }
    }

    /// Sends through `via` (the type's exchange unless told otherwise).
    pub fn via(mut self, via: Via) -> Self {
        self.via = via;
        self
    }

    /// The exchange a message to one of `names`' queues goes through.
    fn exchange<'a>(&self, names: &'a QueueNames) -> &'a str {
        match self.via {
            Via::TypeExchange => names.exchange(),
            Via::DefaultExchange => "",
        }
    }

    /// Connections opened so far (1 for a publisher that never lost its link).
    pub fn connections_opened(&self) -> u64 {
        self.link.connects.load(Ordering::Relaxed)
    }

    async fn channel(&self) -> AmqpResult<Shared> {
        self.link.channel().await
    }

    async fn reset(&self) {
        self.link.reset().await
    }

    /// Declares a task type's queues on a channel of its own, within `timeout` (a hung or
    /// overloaded broker must not hold the caller). The channel is closed afterwards, so a
    /// declaration cut off by the timeout leaves nothing pending on the shared one, and
    /// declarations of several types run side by side in the broker.
    pub async fn declare_task_type(
        &self,
        spec: &NamedTaskType,
        timeout: Duration,
    ) -> AmqpResult<()> {
        let result = match tokio::time::timeout(timeout, async {
            let channel = self.link.own_channel().await?;
            let declared = declare_task_type(&channel, spec).await;
            if channel.status().connected() {
                let _ = channel.close(200, "declared").await;
            }
            declared
        })
        .await
        {
            Ok(result) => result,
            Err(_) => Err(AmqpError::DeclareTimeout(timeout)),
        };
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
            .confirmed(
                &channel,
                self.exchange(&names),
                &names.main,
                body,
                properties,
            )
            .await;
        // A missing queue or exchange is the type's state, not the link's: a channel it
        // closed is reopened by the next call, on the same connection.
        if let Err(err) = &result {
            if self.link_failed(err).await {
                self.reset().await;
            }
        }
        result
    }

    /// Publishes every message, pipelined, and returns once the broker confirmed each one.
    /// The batch is cut into runs, one per channel; the result per message is in input
    /// order; any failure also resets the link.
    pub async fn publish(&self, batch: &[Outgoing]) -> Vec<AmqpResult<()>> {
        let channels = match self.link.channels().await {
            Ok(channels) => channels,
            Err(err) => return batch.iter().map(|_| Err(clone_error(&err))).collect(),
        };
        let start = self.turn.fetch_add(1, Ordering::Relaxed);
        let runs = channels.len().min(batch.len()).max(1);
        let sends = batch.iter().enumerate().map(|(i, out)| {
            // Message i of n goes to run i·runs/n: contiguous runs of nearly equal length.
            let run = i * runs / batch.len();
            self.publish_one(&channels[(start + run) % channels.len()], out)
        });
        let results = join_all(sends).await;
        for result in &results {
            if let Err(err) = result {
                if self.link_failed(err).await {
                    self.reset().await;
                    break;
                }
            }
        }
        results
    }

    /// Whether `err` says the connection itself is gone or hung. A publish that met a
    /// channel closed under it (by another message's missing exchange) is not that: the
    /// closed channel is replaced on the next call, and the connection, which every other
    /// publish shares, stays. Nor is a confirm that timed out while others kept coming (one
    /// slow queue, which a tenant can make of its own).
    async fn link_failed(&self, err: &AmqpError) -> bool {
        match err {
            AmqpError::ConnectTimeout(_) => true,
            AmqpError::ConfirmTimeout(window) => !self.link.last_confirm.within(*window),
            AmqpError::Unavailable(_) => !self.link.is_open().await,
            _ => false,
        }
    }

    async fn publish_one(&self, channel: &Shared, out: &Outgoing) -> AmqpResult<()> {
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
        if let Some(traceparent) = &out.message.traceparent {
            // Where W3C trace context goes in a message, for any consumer that reads it.
            let mut headers = FieldTable::default();
            headers.insert(
                ShortString::from(TRACEPARENT_HEADER),
                AMQPValue::LongString(LongString::from(traceparent.as_str())),
            );
            properties = properties.with_headers(headers);
        }
        if let Some(delay) = out.delay {
            // Per-message TTL: the retry queue dead-letters it to the work queue on expiry.
            properties =
                properties.with_expiration(ShortString::from(delay.as_millis().to_string()));
        }
        self.confirmed(channel, self.exchange(&names), queue, body, properties)
            .await
    }

    /// One mandatory publish through `exchange` to `queue`, confirmed within the confirm
    /// timeout. Its message id must be unique: a return is matched to its publish by it.
    async fn confirmed(
        &self,
        shared: &Shared,
        exchange: &str,
        queue: &str,
        body: Vec<u8>,
        properties: BasicProperties,
    ) -> AmqpResult<()> {
        let confirms = shared
            .confirms
            .as_ref()
            .expect("a publisher's channels are in confirm mode");
        let answer = confirms.publish(Message {
            exchange: exchange.to_owned(),
            routing_key: queue.to_owned(),
            body,
            properties,
        });
        let answer = match tokio::time::timeout(self.confirm_timeout, answer).await {
            Err(_) => return Err(AmqpError::ConfirmTimeout(self.confirm_timeout)),
            Ok(Err(_)) => Err(lapin::Error::InvalidChannelState(
                lapin::ChannelState::Closed,
            )),
            Ok(Ok(answer)) => answer,
        };
        match answer {
            // No such exchange: the type is not declared (or was deleted), as for a return.
            Err(lapin::Error::ProtocolError(e)) if e.get_id() == 404 => Err(AmqpError::NoQueue {
                queue: queue.to_owned(),
            }),
            Err(err) => Err(AmqpError::Unavailable(err)),
            Ok(Confirmed::Routed) => Ok(()),
            Ok(Confirmed::Returned) => Err(AmqpError::NoQueue {
                queue: queue.to_owned(),
            }),
            Ok(Confirmed::Nacked) => Err(AmqpError::Nacked),
        }
    }
}

/// Reads queue depths on a connection of its own, never the publisher's: a depth poll or
/// readiness probe on a queue that does not exist (a TaskType being created or deleted)
/// closes only this channel, which is reopened on the same connection.
pub struct QueueObserver {
    link: Link,
    /// One read at a time: the broker closes the channel on a missing queue (a 404) and
    /// lapin fails every read pending on it with that 404, so another tenant's queue read at
    /// the same moment was told it did not exist (issue 33).
    reading: tokio::sync::Mutex<()>,
}

impl QueueObserver {
    pub fn new(url: impl Into<String>, name: impl Into<String>) -> Self {
        QueueObserver {
            reading: tokio::sync::Mutex::new(()),
            link: Link::new(url.into(), name.into(), false, 1),
        }
    }

    /// Ready messages in a queue; a missing queue is [`AmqpError::NoQueue`].
    pub async fn ready_count(&self, queue: &str) -> AmqpResult<u32> {
        self.read(|channel| async move { ready_count(&channel, queue).await })
            .await
    }

    /// Ready messages and consumers of a queue; a missing queue is [`AmqpError::NoQueue`].
    pub async fn counts(&self, queue: &str) -> AmqpResult<QueueCounts> {
        self.read(|channel| async move { queue_counts(&channel, queue).await })
            .await
    }

    /// Connections opened so far (1 for an observer that never lost its link).
    pub fn connections_opened(&self) -> u64 {
        self.link.connects.load(Ordering::Relaxed)
    }

    /// `read` alone on the shared channel (see `reading`). A channel the last read's 404
    /// closed is reopened first; a read that still finds it closing goes again once, and
    /// only a second failure resets the connection (the broker is gone, not one queue).
    async fn read<T, F, Fut>(&self, read: F) -> AmqpResult<T>
    where
        F: Fn(Channel) -> Fut,
        Fut: std::future::Future<Output = AmqpResult<T>>,
    {
        let _alone = self.reading.lock().await;
        let channel = self.link.channel().await?.channel;
        let result = match read(channel).await {
            Err(AmqpError::Unavailable(_)) => read(self.link.channel().await?.channel).await,
            done => done,
        };
        if matches!(
            result,
            Err(AmqpError::Unavailable(_) | AmqpError::ConnectTimeout(_))
        ) {
            self.link.reset().await;
        }
        result
    }
}
