//! Settling deliveries through `amqp::Settler` against the real broker: acks that come
//! together go out as one `multiple` ack, which must never settle a delivery still in hand.
//! Judged by the broker: what comes back to the queue once the channel is gone.

use std::time::Duration;

use conveyor_core::amqp::{self, Settlement, Settler};
use conveyor_core::testing::{self, unique_type};
use futures_util::future::join_all;
use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};

/// A quorum queue of its own holding messages "0" … "n-1", and a consuming channel that
/// has been handed all of them (unsettled), in order.
async fn handed_out(n: u16) -> (Connection, Channel, String, Vec<lapin::message::Delivery>) {
    let conn = amqp::connect(&testing::amqp_url(), "settling-test")
        .await
        .unwrap();
    let queue = unique_type("conveyor-settling");
    let setup = conn.create_channel().await.unwrap();
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    setup
        .queue_declare(&queue, durable, arguments)
        .await
        .unwrap();
    setup
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for i in 0..n {
        setup
            .basic_publish(
                "",
                &queue,
                BasicPublishOptions::default(),
                i.to_string().as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let channel = conn.create_channel().await.unwrap();
    channel
        .basic_qos(n, BasicQosOptions::default())
        .await
        .unwrap();
    let mut consumer = channel
        .basic_consume(
            &queue,
            "settling-test",
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut deliveries = Vec::new();
    for _ in 0..n {
        let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("a delivery within 10 s")
            .unwrap()
            .unwrap();
        deliveries.push(delivery);
    }
    (conn, channel, queue, deliveries)
}

/// The queue's ready and unacknowledged counts, as the management API shows them (it
/// refreshes them every few seconds: callers wait for the counts they expect).
/// `None` while the API does not answer (a busy broker): callers wait on.
async fn broker_counts(http: &reqwest::Client, queue: &str) -> Option<(u64, u64)> {
    let mut url = reqwest::Url::parse(&testing::management_url()).unwrap();
    let user = url.username().to_owned();
    let password = url.password().map(str::to_owned);
    url.set_username("").unwrap();
    url.set_password(None).unwrap();
    let queue: serde_json::Value = http
        .get(url.join(&format!("api/queues/%2f/{queue}")).unwrap())
        .basic_auth(user, password)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    let count = |field: &str| queue[field].as_u64();
    Some((count("messages_ready")?, count("messages_unacknowledged")?))
}

async fn wait_for_counts(queue: &str, ready: u64, unacked: u64) {
    let http = testing::http_client();
    testing::wait_until(
        &format!("{queue} holds {ready} ready and {unacked} unacknowledged"),
        Duration::from_secs(90),
        || async {
            let counts = broker_counts(&http, queue).await;
            if counts != Some((ready, unacked)) {
                // The API refreshes its counts every few seconds: no need to ask often.
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
            counts == Some((ready, unacked))
        },
    )
    .await;
}

/// A round trip on `channel`: an ack of a tag the broker does not know (settled already)
/// makes it close the channel, and this call fails.
async fn still_open(channel: &Channel, queue: &str) {
    amqp::ready_count(channel, queue)
        .await
        .expect("the broker kept the channel open: no tag was settled twice");
}

async fn delete(conn: &Connection, queue: &str) {
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_delete(queue, QueueDeleteOptions::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn acks_that_come_together_settle_every_delivery_once() {
    let (conn, channel, queue, deliveries) = handed_out(50).await;
    let settler = Settler::spawn(channel.clone());
    let acks = deliveries
        .iter()
        .map(|d| settler.settle(d.delivery_tag, Settlement::Ack));
    for result in join_all(acks).await {
        result.unwrap();
    }
    still_open(&channel, &queue).await;
    wait_for_counts(&queue, 0, 0).await;
    delete(&conn, &queue).await;
}

#[tokio::test]
async fn a_multiple_ack_never_settles_a_delivery_still_in_hand() {
    let (conn, channel, queue, deliveries) = handed_out(12).await;
    let settler = Settler::spawn(channel.clone());
    // The second delivery is still running (an hour-long transcode); the fourth is handed
    // back to the queue (whose consumer is gone: it stays there); every other one is done,
    // all at once.
    let settles = deliveries
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 1)
        .map(|(i, d)| {
            let how = if i == 3 {
                Settlement::Nack { requeue: true }
            } else {
                Settlement::Ack
            };
            settler.settle(d.delivery_tag, how)
        });
    for result in join_all(settles).await {
        result.unwrap();
    }
    still_open(&channel, &queue).await;
    // The nacked one is back in the queue; the one in hand is still out.
    wait_for_counts(&queue, 1, 1).await;
    // And the broker still takes its ack: no `multiple` ack covered it.
    settler
        .settle(deliveries[1].delivery_tag, Settlement::Ack)
        .await
        .unwrap();
    still_open(&channel, &queue).await;
    wait_for_counts(&queue, 1, 0).await;
    // Settling it again is refused here, not sent (the broker would close the channel).
    assert!(settler
        .settle(deliveries[1].delivery_tag, Settlement::Ack)
        .await
        .is_err());
    still_open(&channel, &queue).await;
    delete(&conn, &queue).await;
}
