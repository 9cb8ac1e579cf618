//! Costs that follow the work, not what exists (issue 32, item 6), on the real PostgreSQL
//! and RabbitMQ: what a point-in-time read, an idle process and idle task types cost.

use std::time::Duration;

use conveyor_core::db::{Db, DbOptions, Locked};
use conveyor_core::lifecycle::TaskState;
use conveyor_core::task::NewTask;
use conveyor_core::testing::{self, unique_type, wait_until, TestDatabase};
use serde_json::json;
use uuid::Uuid;

use crate::support::{new_task, test_type, Harness};

/// Index scans of the audit log by task (`task_events_task` on every partition) so far.
async fn audit_probes(db: &Db) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(idx_scan), 0)::bigint FROM pg_stat_user_indexes
         WHERE relname LIKE 'task_events%' AND indexrelname LIKE '%task_id%'",
    )
    .fetch_one(db.pool())
    .await
    .unwrap()
}

/// `state-at` over a type probed the audit log once per task the type ever had: minutes at
/// tens of millions of rows. Only the tasks that changed since shortly before the instant
/// asked about are looked up in the log now; the rest are as they are.
#[tokio::test]
async fn a_point_in_time_read_probes_only_the_tasks_changed_since() {
    let test = TestDatabase::create().await;
    let db = &test.db;
    let task_type = unique_type("pointintime");
    const TASKS: usize = 2_000;
    let tasks: Vec<NewTask> = (0..TASKS)
        .map(|_| new_task(&task_type, Uuid::new_v4()))
        .collect();
    db.record_tasks(&tasks).await.unwrap();
    let ids: Vec<Uuid> = tasks.iter().map(|t| t.id).collect();
    db.mark_queued(&ids, Locked::Wait).await.unwrap();
    // The type's history so far happened an hour ago (moved back by the tables' owner).
    for table in [
        "tasks SET updated_at = updated_at",
        "task_events SET at = at",
    ] {
        sqlx::query(&format!(
            "UPDATE {table} - interval '1 hour' WHERE task_type = $1"
        ))
        .bind(&task_type)
        .execute(db.pool())
        .await
        .unwrap();
    }
    let then = chrono::Utc::now() - chrono::Duration::minutes(30);
    for id in &ids[..3] {
        assert!(db.claim(*id, 0, "w").await.unwrap().won());
        assert!(db
            .complete(*id, 0, "w", &serde_json::json!({}))
            .await
            .unwrap());
    }
    let late = new_task(&task_type, Uuid::new_v4());
    db.record_tasks(std::slice::from_ref(&late)).await.unwrap();
    // Index scans reach the statistics view when a backend reports them, at the latest when
    // it exits: the setup's connections go, then a fresh one reads, and goes.
    db.close().await;
    let watcher = Db::connect(&DbOptions {
        max_connections: 1,
        ..DbOptions::new(&test.url)
    })
    .unwrap();
    until_alone(&watcher).await;
    let before = audit_probes(&watcher).await;
    let reader = Db::connect(&DbOptions::new(&test.url)).unwrap();
    let states = reader
        .states_at(then, Some(&task_type), None)
        .await
        .unwrap();
    assert_eq!(states.len(), TASKS, "the late task did not exist then");
    assert!(states
        .iter()
        .all(|(_, state, _)| *state == TaskState::Queued));
    assert!(states.iter().all(|(_, _, since)| *since <= then));
    let now = reader
        .states_at(chrono::Utc::now(), Some(&task_type), None)
        .await
        .unwrap();
    let completed = now
        .iter()
        .filter(|(_, s, _)| *s == TaskState::Completed)
        .count();
    assert_eq!((now.len(), completed), (TASKS + 1, 3));
    reader.close().await;
    until_alone(&watcher).await;

    // The four tasks with transitions since (three completed, one created) are probed by
    // each read; a probe per task would be 4,000 or more.
    let probes = audit_probes(&watcher).await - before;
    assert!(
        (4..200).contains(&probes),
        "{probes} probes of the audit log for a type of {TASKS} tasks, 4 of which changed"
    );
}

/// Waits until `watcher`'s is the only client connection to its database: the others have
/// exited, and so reported their statistics. A closed pool may leave an idle connection
/// behind for a while (seen once in a few runs): after a second, idle ones are ended (a
/// backend reports its statistics as it exits, terminated or not).
async fn until_alone(watcher: &Db) {
    let mut others: Vec<String> = Vec::new();
    for round in 0..300 {
        if round >= 5 {
            sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                 WHERE datname = current_database() AND backend_type = 'client backend'
                     AND pid <> pg_backend_pid() AND state = 'idle'",
            )
            .execute(watcher.pool())
            .await
            .unwrap();
        }
        others = sqlx::query_scalar(
            "SELECT format('%s %s %s: %s', pid, application_name, state, left(query, 80))
             FROM pg_stat_activity
             WHERE datname = current_database() AND backend_type = 'client backend'
                 AND pid <> pg_backend_pid()",
        )
        .fetch_all(watcher.pool())
        .await
        .unwrap();
        if others.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("other connections stayed for 60 s: {others:?}");
}

/// Each process kept every connection its busiest moment opened (two pools of 16 each, for
/// ten minutes or more), so the server's connections grew with the fleet of idle tenants'
/// workers. A process at rest now closes them.
#[tokio::test]
async fn a_process_at_rest_closes_its_database_connections() {
    let test = TestDatabase::create().await;
    let (resting, open) = named_pool(&test, "atrest", Duration::from_secs(60));
    burst_of_six(&resting, &open).await;
    wait_until(
        "the resting process closed its connections",
        Duration::from_secs(30),
        || {
            let open = &open;
            async move { open().await == 0 }
        },
    )
    .await;
}

/// The soak's PostgreSQL grew from 36 processes to 50 in 20 minutes: the gateway's pool
/// hands out idle connections first in, first out, so its upkeep loops touched each one in
/// turn, none was ever idle for the idle timeout, and every connection of the busiest moment
/// stayed. An age limit lets the pool sink back to what the trickle needs.
#[tokio::test]
async fn a_trickle_of_work_keeps_only_the_connections_it_needs() {
    let test = TestDatabase::create().await;
    let (pool, open) = named_pool(&test, "trickle", Duration::from_secs(3));
    burst_of_six(&pool, &open).await;
    let trickle = {
        let pool = pool.clone();
        tokio::spawn(async move {
            loop {
                sqlx::query("SELECT 1").execute(pool.pool()).await.unwrap();
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    // One statement at a time needs one connection; the main and hot pools' lazy opening may
    // leave one more for a moment.
    wait_until(
        "the pool sank back to what a trickle needs",
        Duration::from_secs(60),
        || {
            let open = &open;
            async move { open().await <= 2 }
        },
    )
    .await;
    trickle.abort();
}

type OpenCount = Box<dyn Fn() -> futures_util::future::BoxFuture<'static, i64>>;

/// A pool whose connections carry a name of their own (idle ones closed after 2 s, any
/// after `max_lifetime`), and a count of its connections open at the server.
fn named_pool(test: &TestDatabase, prefix: &str, max_lifetime: Duration) -> (Db, OpenCount) {
    let name = format!("{prefix}{}", Uuid::new_v4().simple());
    let separator = if test.url.contains('?') { '&' } else { '?' };
    let url = format!("{}{separator}application_name={name}", test.url);
    let pool = Db::connect(&DbOptions {
        idle_timeout: Duration::from_secs(2),
        max_lifetime,
        ..DbOptions::new(url)
    })
    .unwrap();
    let db = test.db.clone();
    let open: OpenCount = Box::new(move || {
        let (db, name) = (db.clone(), name.clone());
        Box::pin(async move {
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
                .bind(name)
                .fetch_one(db.pool())
                .await
                .unwrap()
        })
    });
    (pool, open)
}

/// Six statements at once: they open four connections or more (counted while they run).
async fn burst_of_six(pool: &Db, open: &OpenCount) {
    let busy = (0..6).map(|_| {
        let pool = pool.clone();
        async move {
            sqlx::query("SELECT pg_sleep(3)")
                .execute(pool.pool())
                .await
                .unwrap();
        }
    });
    let burst = tokio::spawn(futures_util::future::join_all(busy));
    wait_until(
        "the burst opened connections",
        Duration::from_secs(30),
        || async move { open().await >= 4 },
    )
    .await;
    burst.await.unwrap();
}

/// Frames the broker has received on `user`'s connections named `name` (its statistics,
/// refreshed every few seconds).
async fn frames_received(user: &str, name: &str) -> u64 {
    let connections: Vec<serde_json::Value> = testing::http_client()
        .get(format!(
            "{}/api/connections?columns=user,user_provided_name,recv_cnt",
            testing::management_url()
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    connections
        .iter()
        .filter(|c| c["user"] == user && c["user_provided_name"] == name)
        .map(|c| c["recv_cnt"].as_u64().unwrap_or(0))
        .sum()
}

/// A gateway read every idle type's queues every 30 s, one passive declare per queue: at ten
/// thousand types, a thousand broker calls a second from each replica, for nothing. An idle
/// type now costs nothing after its first reading. Counted by the broker, on the gateway's
/// depth connection (a broker user of its own tells it apart from other tests').
#[tokio::test]
async fn a_gateway_reads_no_idle_types_depth() {
    let user = format!("idle-depths-{}", &Uuid::new_v4().simple().to_string()[..8]);
    let admin = testing::http_client();
    let management = testing::management_url();
    let everything = json!({"configure": ".*", "write": ".*", "read": ".*"});
    for (path, body) in [
        (
            format!("users/{user}"),
            json!({"password": "idle", "tags": ""}),
        ),
        (format!("permissions/%2F/{user}"), everything),
    ] {
        admin
            .put(format!("{management}/api/{path}"))
            .json(&body)
            .send()
            .await
            .unwrap()
            .error_for_status()
            .unwrap();
    }
    let dev_url = testing::amqp_url();
    let amqp_url = dev_url.replacen("conveyor:conveyor@", &format!("{user}:idle@"), 1);
    assert_ne!(
        amqp_url, dev_url,
        "the dev broker URL names the conveyor user"
    );
    let types: Vec<_> = (0..10).map(|_| test_type("idle")).collect();
    let harness = Harness::start_with(types.clone(), |config| config.amqp_url = amqp_url).await;

    // Each type's first reading (two queues each), seen in the broker's statistics.
    let depths = "conveyor-gateway/depths";
    wait_until(
        "the gateway's first readings",
        Duration::from_secs(60),
        || async { frames_received(&user, depths).await >= 2 * types.len() as u64 },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let before = frames_received(&user, depths).await;
    tokio::time::sleep(conveyor_gateway::backpressure::STALE_AFTER + Duration::from_secs(15)).await;
    let after = frames_received(&user, depths).await;
    // Heartbeats are all that may come in meanwhile.
    assert!(
        after - before < types.len() as u64,
        "{} frames from an idle gateway with {} idle types",
        after - before,
        types.len()
    );

    harness.shutdown().await;
    for spec in &types {
        testing::delete_queues(&spec.name).await;
    }
    let _ = admin
        .delete(format!("{management}/api/users/{user}"))
        .send()
        .await;
}
