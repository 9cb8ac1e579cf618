//! Months unattended (issue 32): tenant roles that cannot stall upkeep, a sweeper whose
//! cost follows what waits, and settled tasks that expire, on the real PostgreSQL (the
//! audit log's partitions are in `audit_partitions`).

use std::time::Duration;

use conveyor_core::db::{Db, Locked, OrphanRule, TenantRole};
use conveyor_core::task::NewTask;
use conveyor_core::testing::{unique_type, TestDatabase};

use crate::support::{connect_as, days_ago, new_task};
use uuid::Uuid;

fn denied(result: &Result<sqlx::postgres::PgQueryResult, sqlx::Error>) -> bool {
    matches!(result, Err(sqlx::Error::Database(err)) if err.code().as_deref() == Some("42501"))
}

#[tokio::test]
async fn a_tenants_role_can_neither_forge_audit_times_nor_move_probes_nor_lock_tables() {
    let database = TestDatabase::create().await;
    let db = &database.db;
    let tenant = format!("t-{}", &Uuid::new_v4().simple().to_string()[..8]);
    let role = TenantRole::new(&tenant).unwrap();
    // A role granted the whole tables, as before the fix, is narrowed by its next grant.
    db.grant_tenant(&role).await.unwrap();
    for table in ["INSERT ON task_events", "UPDATE ON queue_probes"] {
        sqlx::query(&format!("GRANT {table} TO \"{}\"", role.name()))
            .execute(db.pool())
            .await
            .unwrap();
    }
    let role = TenantRole::new(&tenant).unwrap();
    db.grant_tenant(&role).await.unwrap();

    let task_type = format!("{tenant}.transcode");
    let task = NewTask {
        tenant: tenant.clone(),
        ..new_task(&task_type, Uuid::new_v4())
    };
    db.record_tasks(std::slice::from_ref(&task)).await.unwrap();
    let probe: Uuid = sqlx::query_scalar(
        "INSERT INTO queue_probes (id, task_type) VALUES (gen_random_uuid(), $1) RETURNING id",
    )
    .bind(&task_type)
    .fetch_one(db.pool())
    .await
    .unwrap();

    let tenant_db = connect_as(&database, role.name(), role.password());
    let pool = tenant_db.pool();
    // An audit row in a day of its choosing: refused. One at the database's time: fine.
    let forged = sqlx::query(
        "INSERT INTO task_events (task_id, task_type, to_state, attempt, at)
         VALUES ($1, $2, 'INGESTED', 0, now() + interval '300 days')",
    )
    .bind(task.id)
    .bind(&task_type)
    .execute(pool)
    .await;
    assert!(denied(&forged), "{forged:?}");
    sqlx::query(
        "INSERT INTO task_events (task_id, task_type, to_state, attempt)
         VALUES ($1, $2, 'INGESTED', 0)",
    )
    .bind(task.id)
    .bind(&task_type)
    .execute(pool)
    .await
    .unwrap();
    // A probe's send time: refused. Marking it seen: fine.
    let moved =
        sqlx::query("UPDATE queue_probes SET sent_at = now() + interval '1 year' WHERE id = $1")
            .bind(probe)
            .execute(pool)
            .await;
    assert!(denied(&moved), "{moved:?}");
    tenant_db.probe_seen(probe).await.unwrap();
    // No lock that keeps others out.
    for table in ["queue_probes", "tasks", "task_events"] {
        let mut tx = pool.begin().await.unwrap();
        let locked = sqlx::query(&format!("LOCK TABLE {table} IN EXCLUSIVE MODE"))
            .execute(&mut *tx)
            .await;
        assert!(denied(&locked), "{table}: {locked:?}");
    }

    // What it can still write cannot make the sweeper re-publish: a probe marked seen
    // before it was sent proves nothing.
    db.mark_queued(&[task.id], Locked::Wait).await.unwrap();
    sqlx::query("UPDATE queue_probes SET seen_at = now() - interval '1 year' WHERE id = $1")
        .bind(probe)
        .execute(pool)
        .await
        .unwrap();
    let rule = OrphanRule {
        grace: Duration::ZERO,
        margin: Duration::ZERO,
        retry_delay_cap: Duration::ZERO,
    };
    assert!(db
        .begin_republish(&task_type, &rule, 100)
        .await
        .unwrap()
        .is_none());
    tenant_db.close().await;
}

/// Index entries of `tasks_waiting` read, and scans of it, in this database so far.
async fn waiting_index_reads(db: &Db) -> (i64, i64) {
    sqlx::query_as(
        "SELECT idx_scan, idx_tup_read FROM pg_stat_user_indexes
         WHERE indexrelname = 'tasks_waiting'",
    )
    .fetch_one(db.pool())
    .await
    .unwrap()
}

/// After a probe came through, the sweeper read a type's whole waiting backlog on every
/// pass (every 2 s): its filter could not bound the index scan (issue 32, item 6). It
/// reads only what was queued before the probe.
#[tokio::test]
async fn the_sweeper_reads_what_waits_before_the_probe_not_the_backlog_behind_it() {
    let db = TestDatabase::create().await.db;
    let task_type = unique_type("behind");
    sqlx::query(
        "INSERT INTO queue_probes (id, task_type, sent_at, seen_at)
         VALUES (gen_random_uuid(), $1, now() - interval '1 hour', now() - interval '59 minutes')",
    )
    .bind(&task_type)
    .execute(db.pool())
    .await
    .unwrap();
    // A healthy backlog, all of it queued after the probe went through.
    const BACKLOG: usize = 5_000;
    for _ in 0..5 {
        let tasks: Vec<NewTask> = (0..BACKLOG / 5)
            .map(|_| new_task(&task_type, Uuid::new_v4()))
            .collect();
        db.record_tasks(&tasks).await.unwrap();
        let ids: Vec<Uuid> = tasks.iter().map(|t| t.id).collect();
        db.mark_queued(&ids, Locked::Wait).await.unwrap();
    }
    sqlx::query("ANALYZE tasks")
        .execute(db.pool())
        .await
        .unwrap();

    let rule = OrphanRule {
        grace: Duration::ZERO,
        margin: Duration::from_secs(1),
        retry_delay_cap: Duration::from_secs(60),
    };
    let (scans, read) = waiting_index_reads(&db).await;
    const PASSES: i64 = 20;
    for _ in 0..PASSES {
        let found = db.begin_republish(&task_type, &rule, 100).await.unwrap();
        assert!(found.is_none(), "a healthy task was taken for lost");
    }
    // Counters reach the view when a session flushes them: wait for the passes' scans.
    conveyor_core::testing::wait_until(
        "the passes' index scans counted",
        Duration::from_secs(60),
        || async { waiting_index_reads(&db).await.0 >= scans + PASSES },
    )
    .await;
    let read = waiting_index_reads(&db).await.1 - read;
    assert!(
        read < PASSES * 10,
        "{read} index entries read in {PASSES} passes over a healthy backlog of {BACKLOG}"
    );
}

/// Settled tasks and their idempotency keys were kept for ever (issue 32, item 5). Past
/// their retention they are archived, then deleted, and their key is free again;
/// dead-lettered, open and recent ones stay.
#[tokio::test]
async fn settled_tasks_past_their_retention_are_archived_then_deleted_and_the_rest_stay() {
    use crate::support::{test_type, Harness};
    use conveyor_gateway::upkeep::{TaskRetention, UpkeepConfig};
    use reqwest::StatusCode;

    let spec = test_type("expiring");
    let name = spec.name.clone();
    let archive = std::env::temp_dir().join(format!("conveyor-archive-{}", Uuid::new_v4()));
    let harness = Harness::start_with(vec![spec], |config| {
        config.upkeep = Some(UpkeepConfig {
            tasks: TaskRetention {
                default_days: Some(30),
                archive: Some(archive.clone()),
                day: conveyor_gateway::upkeep::DAY,
            },
            ..crate::self_healing::fast_upkeep()
        });
    })
    .await;
    // Tasks made 40 days ago (their ids carry that time, as the gateway's do), and one now.
    let made = |days| made_days_ago(&name, days);
    let (done, cancelled, dead, open, recent) = (made(40), made(40), made(40), made(40), made(0));
    let all = [&done, &cancelled, &dead, &open, &recent];
    harness
        .db
        .record_tasks(&all.map(|t| t.clone()))
        .await
        .unwrap();
    for (task, state, days) in [
        (&done, "COMPLETED", 40),
        (&cancelled, "CANCELLED", 35),
        (&dead, "DEAD_LETTER", 40),
        (&open, "QUEUED", 40),
        (&recent, "COMPLETED", 0),
    ] {
        in_state_since(&harness.db, task, state, days).await;
    }

    wait_until_gone(&harness.db, &[done.id, cancelled.id]).await;
    for kept in [&dead, &open, &recent] {
        assert!(
            harness.db.task(kept.id).await.unwrap().is_some(),
            "{kept:?}"
        );
    }
    // Archived, each once, in the file of the day it settled.
    let mut archived = Vec::new();
    for (task, days) in [(&done, 40), (&cancelled, 35)] {
        let day = days_ago(days).format("%Y-%m-%d").to_string();
        let file = archive.join(day).join(format!("{name}.ndjson"));
        let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{file:?}: {e}"));
        for line in text.lines() {
            let record: conveyor_core::task::TaskRecord = serde_json::from_str(line).unwrap();
            archived.push(record.id);
        }
        assert!(archived.contains(&task.id), "{text}");
    }
    archived.sort();
    let mut expected = vec![done.id, cancelled.id];
    expected.sort();
    assert_eq!(archived, expected);
    // The key of a deleted task is free again: the same key makes a new task.
    let (status, body) = harness
        .submit(&name, serde_json::json!({}), Some(done.idempotency_key))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_ne!(body["id"].as_str(), Some(done.id.to_string().as_str()));
    let _ = std::fs::remove_dir_all(&archive);
    harness.shutdown().await;
}

/// A type no TaskType defines, deleted before the gateway started (its queues kept, under
/// `Retain`), kept its settled tasks for ever: its own retention was unknown, and the
/// default applied only once its queues were found gone. It goes by the default now. The
/// dead letters of a type deleted with its queues, which nothing could redrive, were kept
/// for ever with their history: they expire by the default too (decision 0044), while those
/// of a defined type, or of one whose queues were retained, stay until redriven.
#[tokio::test]
async fn settled_tasks_of_a_type_no_longer_defined_expire_by_the_default_retention() {
    use crate::support::{test_type, Harness};
    use conveyor_gateway::upkeep::{TaskRetention, UpkeepConfig};

    let served = test_type("served");
    let forgotten = test_type("forgotten");
    let served_name = served.name.clone();
    // Deleted with its queues (none declared), and with a dead letter left.
    let deleted = unique_type("deleted");
    Harness::publisher_for_tests()
        .declare_task_type(&forgotten, Duration::from_secs(30))
        .await
        .unwrap();
    let harness = Harness::start_with(vec![served], |config| {
        config.upkeep = Some(UpkeepConfig {
            tasks: TaskRetention {
                default_days: Some(30),
                archive: None,
                day: conveyor_gateway::upkeep::DAY,
            },
            ..crate::self_healing::fast_upkeep()
        });
    })
    .await;
    let old = made_days_ago(&forgotten.name, 40);
    let recent = made_days_ago(&forgotten.name, 0);
    let old_dead = made_days_ago(&forgotten.name, 40);
    let recent_dead = made_days_ago(&forgotten.name, 0);
    let served_old = made_days_ago(&served_name, 40);
    let served_dead = made_days_ago(&served_name, 40);
    let deleted_dead = made_days_ago(&deleted, 40);
    let all = [
        &old,
        &recent,
        &old_dead,
        &recent_dead,
        &served_old,
        &served_dead,
        &deleted_dead,
    ];
    harness
        .db
        .record_tasks(&all.map(Clone::clone))
        .await
        .unwrap();
    for (task, state, days) in [
        (&old, "COMPLETED", 40),
        (&recent, "COMPLETED", 0),
        (&old_dead, "DEAD_LETTER", 40),
        (&recent_dead, "DEAD_LETTER", 0),
        (&served_old, "COMPLETED", 40),
        (&served_dead, "DEAD_LETTER", 40),
        (&deleted_dead, "DEAD_LETTER", 40),
    ] {
        in_state_since(&harness.db, task, state, days).await;
    }
    // The other types' old completed tasks go in the same batch as their dead letters would.
    wait_until_gone(&harness.db, &[old.id, served_old.id, deleted_dead.id]).await;
    for kept in [&recent, &old_dead, &recent_dead, &served_dead] {
        assert!(
            harness.db.task(kept.id).await.unwrap().is_some(),
            "{} went",
            kept.id
        );
    }
    harness.shutdown().await;
}

/// A task of `task_type` made `days` days ago: its id carries that time, as the gateway's do.
fn made_days_ago(task_type: &str, days: u64) -> NewTask {
    let at = days_ago(days);
    let ts = uuid::Timestamp::from_unix(
        uuid::NoContext,
        at.timestamp() as u64,
        at.timestamp_subsec_nanos(),
    );
    new_task(task_type, Uuid::new_v7(ts))
}

/// Puts `task` in `state` since `days` days ago (made then too), as the tables' owner.
async fn in_state_since(db: &Db, task: &NewTask, state: &str, days: u64) {
    sqlx::query("UPDATE tasks SET state = $2, created_at = $3, updated_at = $3 WHERE id = $1")
        .bind(task.id)
        .bind(state)
        .bind(days_ago(days))
        .execute(db.pool())
        .await
        .unwrap();
}

async fn wait_until_gone(db: &Db, ids: &[Uuid]) {
    conveyor_core::testing::wait_until(
        "expired tasks deleted",
        Duration::from_secs(30),
        || async {
            for id in ids {
                if db.task(*id).await.unwrap().is_some() {
                    return false;
                }
            }
            true
        },
    )
    .await;
}
