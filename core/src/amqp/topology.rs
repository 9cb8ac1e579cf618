//! Declaring, checking and deleting a task type's exchange and queues.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Connection, ExchangeKind};

use super::error::{AmqpError, AmqpResult};
use super::names::QueueNames;
use crate::task_type::NamedTaskType;

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
    passive_declare(channel, queue)
        .await
        .map(|q| q.message_count())
}

/// A queue's ready messages and consumers right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueCounts {
    pub ready: u32,
    pub consumers: u32,
}

/// [`QueueCounts`] of a queue, read with a passive declare. A missing queue is `NoQueue`.
pub async fn queue_counts(channel: &Channel, queue: &str) -> AmqpResult<QueueCounts> {
    passive_declare(channel, queue).await.map(|q| QueueCounts {
        ready: q.message_count(),
        consumers: q.consumer_count(),
    })
}

async fn passive_declare(channel: &Channel, queue: &str) -> AmqpResult<lapin::Queue> {
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue, options, FieldTable::default())
        .await
        .map_err(|source| match &source {
            lapin::Error::ProtocolError(e) if e.get_id() == 404 => AmqpError::NoQueue {
                queue: queue.to_owned(),
            },
            _ => AmqpError::Unavailable(source),
        })
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

#[cfg(test)]
mod tests {
    use super::*;

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
