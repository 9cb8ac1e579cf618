//! Consuming: channels with a prefetch, one-off gets, and probes told from tasks.

use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, Consumer};
use uuid::Uuid;

use super::error::{AmqpError, AmqpResult};

/// The message type of a probe (decision 0011); task messages carry none.
pub const PROBE_KIND: &str = "conveyor.probe";

/// The probe id, if `delivery` is a probe rather than a task.
/// The `traceparent` header of a task message, if it carries one.
pub fn traceparent(delivery: &lapin::message::Delivery) -> Option<String> {
    let headers = delivery.properties.headers().as_ref()?;
    match headers.inner().get(super::publisher::TRACEPARENT_HEADER)? {
        lapin::types::AMQPValue::LongString(value) => {
            Some(String::from_utf8_lossy(value.as_bytes()).into_owned())
        }
        lapin::types::AMQPValue::ShortString(value) => Some(value.as_str().to_owned()),
        _ => None,
    }
}

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
