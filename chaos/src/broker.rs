//! Broker-side faults: what takes messages away from a queue without any task failing
//! (decision 0011). All of the suite's own AMQP calls are here.

use conveyor_core::amqp::{self, QueueNames, QueueObserver};
use conveyor_core::task_type::NamedTaskType;
use conveyor_core::testing;
use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicNackOptions, BasicQosOptions, QueuePurgeOptions};
use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;

async fn channel() -> anyhow::Result<(lapin::Connection, lapin::Channel)> {
    let conn = amqp::connect(&testing::amqp_url(), "conveyor-chaos-fault").await?;
    let channel = conn.create_channel().await?;
    Ok((conn, channel))
}

/// Purges the work queue (as from the management UI); returns how many messages went.
pub async fn purge(task_type: &str) -> anyhow::Result<u32> {
    let (conn, channel) = channel().await?;
    let purged = channel
        .queue_purge(
            &QueueNames::of(task_type).main,
            QueuePurgeOptions::default(),
        )
        .await?;
    let _ = conn.close(200, "purged").await;
    Ok(purged)
}

/// Deletes the work queue with everything in it, then declares it again (with the same
/// arguments, as the operator would); returns how many messages were deleted.
pub async fn delete_and_redeclare(spec: &NamedTaskType) -> anyhow::Result<u32> {
    let (conn, channel) = channel().await?;
    let deleted = channel
        .queue_delete(&QueueNames::of(&spec.name).main, Default::default())
        .await?;
    amqp::declare_task_type(&channel, spec).await?;
    let _ = conn.close(200, "re-declared").await;
    Ok(deleted)
}

/// Messages parked in the remediation queue.
pub async fn remediation_depth(task_type: &str) -> anyhow::Result<u32> {
    let observer = QueueObserver::new(testing::amqp_url(), "conveyor-chaos-depth");
    Ok(observer
        .ready_count(&QueueNames::of(task_type).remediation)
        .await?)
}

/// The broker accepts connections again.
pub async fn reachable() -> bool {
    match amqp::connect(&testing::amqp_url(), "conveyor-chaos-probe").await {
        Ok(conn) => {
            let _ = conn.close(200, "reachable").await;
            true
        }
        Err(_) => false,
    }
}

/// Consumers that hand every delivery of the work queue back with a requeue.
pub struct Rogue {
    conn: lapin::Connection,
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Rogue {
    pub async fn start(task_type: &str) -> anyhow::Result<Rogue> {
        let (conn, channel) = channel().await?;
        channel.basic_qos(200, BasicQosOptions::default()).await?;
        let stop = CancellationToken::new();
        let mut tasks = Vec::new();
        for n in 0..3 {
            let mut consumer = channel
                .basic_consume(
                    &QueueNames::of(task_type).main,
                    &format!("chaos-rogue-{n}"),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                loop {
                    let delivery = tokio::select! {
                        _ = stop.cancelled() => return,
                        next = consumer.next() => match next {
                            Some(Ok(delivery)) => delivery,
                            _ => return,
                        },
                    };
                    let requeue = BasicNackOptions {
                        requeue: true,
                        ..Default::default()
                    };
                    let _ = delivery.acker.nack(requeue).await;
                }
            }));
        }
        Ok(Rogue { conn, stop, tasks })
    }

    /// Stops handing back; what it still holds returns to the queue.
    pub async fn stop(self) {
        self.stop.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
        let _ = self.conn.close(200, "rogue done").await;
    }
}
