//! Costs that follow the work, not what exists (issue 32, item 6), on the real PostgreSQL:
//! what a point-in-time read and an idle process cost.

use std::time::Duration;

use conveyor_core::db::{Db, DbOptions, Locked};
use conveyor_core::lifecycle::TaskState;
use conveyor_core::task::NewTask;
use conveyor_core::testing::{unique_type, wait_until, TestDatabase};

use uuid::Uuid;

use crate::support::new_task;

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
    let name = format!("atrest{}", Uuid::new_v4().simple());
    let separator = if test.url.contains('?') { '&' } else { '?' };
    let url = format!("{}{separator}application_name={name}", test.url);
    let resting = Db::connect(&DbOptions {
        idle_timeout: Duration::from_secs(2),
        ..DbOptions::new(url)
    })
    .unwrap();
    let open = || {
        let (db, name) = (test.db.clone(), name.clone());
        async move {
            let open: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            )
            .bind(name)
            .fetch_one(db.pool())
            .await
            .unwrap();
            open
        }
    };
    // A burst of six statements at once opens several connections (counted while it runs).
    let busy = (0..6).map(|_| {
        let resting = resting.clone();
        async move {
            sqlx::query("SELECT pg_sleep(3)")
                .execute(resting.pool())
                .await
                .unwrap();
        }
    });
    let burst = tokio::spawn(futures_util::future::join_all(busy));
    wait_until(
        "the burst opened connections",
        Duration::from_secs(30),
        || {
            let open = &open;
            async move { open().await >= 2 }
        },
    )
    .await;
    burst.await.unwrap();
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
