//! The raw floor of this machine, with no application in the way: what RabbitMQ does for a
//! confirmed publish, a consume and an ack on a quorum queue, and what PostgreSQL does for
//! batched audit inserts. Conveyor's figures are read as ratios to these, measured in the
//! same run (the machine's speed varies from day to day). The links are the product's own:
//! AMQPS and PostgreSQL over TLS.

use std::time::Instant;

use anyhow::Context as _;
use conveyor_core::amqp;
use futures_util::stream::{FuturesUnordered, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::BasicProperties;
use sqlx::PgPool;
use uuid::Uuid;

/// Confirms outstanding at once: the publisher pipelines, as the gateway does.
const CONFIRM_WINDOW: usize = 1000;
/// The consumer's prefetch.
const PREFETCH: u16 = 500;
/// Acks written at once by the floor's consumer.
const ACKS_IN_FLIGHT: usize = 64;
/// A message about the size of a task message.
const BODY_BYTES: usize = 320;

/// Messages per second through one quorum queue: publish (persistent, confirmed) → consume
/// → ack each, from the first publish to the last ack.
pub async fn broker(url: &str, messages: usize) -> anyhow::Result<f64> {
    let queue = format!("conveyor-bench.floor.{}", Uuid::new_v4().simple());
    let publisher = amqp::connect(url, "conveyor-bench/floor-publish").await?;
    let consumer = amqp::connect(url, "conveyor-bench/floor-consume").await?;
    let channel = publisher.create_channel().await?;
    let mut arguments = FieldTable::default();
    arguments.insert(
        ShortString::from("x-queue-type"),
        AMQPValue::LongString("quorum".into()),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel.queue_declare(&queue, durable, arguments).await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let consuming = consumer.create_channel().await?;
    consuming
        .basic_qos(PREFETCH, BasicQosOptions::default())
        .await?;
    let mut deliveries = consuming
        .basic_consume(
            &queue,
            "floor",
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;

    let started = Instant::now();
    // Each message acked on its own, as a worker does, but without waiting for one ack to
    // be written before taking the next delivery.
    let consume = async {
        let mut acks = FuturesUnordered::new();
        for _ in 0..messages {
            let delivery = deliveries
                .next()
                .await
                .context("the floor queue's consumer ended")??;
            acks.push(async move { delivery.acker.ack(BasicAckOptions::default()).await });
            // Well inside the prefetch: acks are sent as this set is polled, and the broker
            // stops delivering at the prefetch until they are.
            while acks.len() >= ACKS_IN_FLIGHT {
                acks.next().await.context("ack")??;
            }
        }
        while let Some(ack) = acks.next().await {
            ack?;
        }
        anyhow::Ok(())
    };
    let publish = async {
        let body = vec![b'x'; BODY_BYTES];
        let mut pending = FuturesUnordered::new();
        for _ in 0..messages {
            if pending.len() >= CONFIRM_WINDOW {
                confirmed(pending.next().await)?;
            }
            let confirm = channel
                .basic_publish(
                    "",
                    &queue,
                    BasicPublishOptions::default(),
                    &body,
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await?;
            pending.push(confirm);
        }
        while let Some(confirm) = pending.next().await {
            confirmed(Some(confirm))?;
        }
        anyhow::Ok(())
    };
    let (published, consumed) = tokio::join!(publish, consume);
    published.context("floor publish")?;
    consumed.context("floor consume")?;
    let rate = messages as f64 / started.elapsed().as_secs_f64();
    let _ = channel
        .queue_delete(&queue, QueueDeleteOptions::default())
        .await;
    let _ = publisher.close(200, "floor measured").await;
    let _ = consumer.close(200, "floor measured").await;
    Ok(rate)
}

fn confirmed(
    confirm: Option<Result<lapin::publisher_confirm::Confirmation, lapin::Error>>,
) -> anyhow::Result<()> {
    match confirm.context("no confirm")?? {
        lapin::publisher_confirm::Confirmation::Ack(_) => Ok(()),
        other => anyhow::bail!("the broker did not confirm a floor message: {other:?}"),
    }
}

/// Writers of the audit floor at once: the database's capacity, not one session's.
const AUDIT_WRITERS: usize = 4;

/// Rows per second of audit-shaped inserts (the audit log's columns and indexes, on a plain
/// table), `batch` rows per statement, each statement its own commit, from a few sessions.
pub async fn audit_inserts(pool: &PgPool, rows: usize, batch: usize) -> anyhow::Result<f64> {
    sqlx::raw_sql(
        "CREATE TABLE bench_audit (LIKE task_events INCLUDING DEFAULTS);
         CREATE INDEX ON bench_audit (task_id, at, seq)",
    )
    .execute(pool)
    .await
    .context("create the audit floor's table")?;
    let started = Instant::now();
    let per_writer = rows.div_ceil(AUDIT_WRITERS);
    let writers = (0..AUDIT_WRITERS).map(|_| async move {
        let mut written = 0;
        while written < per_writer {
            let n = batch.min(per_writer - written);
            let ids: Vec<Uuid> = (0..n).map(|_| Uuid::now_v7()).collect();
            sqlx::query(
                "INSERT INTO bench_audit (task_id, task_type, from_state, to_state, attempt, worker_id)
                 SELECT id, 'bench', 'PROCESSING', 'COMPLETED', 0, 'bench-worker'
                 FROM unnest($1::uuid[]) AS i(id)",
            )
            .bind(&ids)
            .execute(pool)
            .await?;
            written += n;
        }
        anyhow::Ok(written)
    });
    let written: usize = futures_util::future::try_join_all(writers)
        .await?
        .into_iter()
        .sum();
    let rate = written as f64 / started.elapsed().as_secs_f64();
    sqlx::query("DROP TABLE bench_audit").execute(pool).await?;
    Ok(rate)
}
