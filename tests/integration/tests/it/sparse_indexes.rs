//! Indexes of `tasks` bounded by what the table holds, not by time (issue 32, what must be
//! shown; decision 0037), on the real PostgreSQL.

use std::time::Duration;

use conveyor_core::db::{ComponentRole, Db, DbOptions};
use conveyor_core::testing::{unique_type, wait_until, TestDatabase};
use conveyor_gateway::upkeep::UpkeepConfig;
use reqwest::StatusCode;
use sqlx::Connection;
use uuid::Uuid;

use crate::self_healing::fast_upkeep;
use crate::support::{test_type, Harness};

/// 100,000 settled tasks made in id order, as the gateway makes them.
async fn settled_tasks_in_id_order(db: &Db, task_type: &str) {
    for _ in 0..100 {
        let ids: Vec<Uuid> = (0..1000).map(|_| Uuid::now_v7()).collect();
        sqlx::query(
            "INSERT INTO tasks (id, tenant, idempotency_key, task_type, state, payload)
             SELECT id, 'default', gen_random_uuid(), $2, 'COMPLETED', '{}'
               FROM unnest($1::uuid[]) AS id",
        )
        .bind(&ids)
        .bind(task_type)
        .execute(db.pool())
        .await
        .unwrap();
    }
}

/// Expiry's pattern: all but one task in 250 deleted (the dead letters that stay).
async fn all_but_one_in_250_deleted(db: &Db, task_type: &str) {
    sqlx::query("DELETE FROM tasks WHERE task_type = $1 AND abs(hashtext(id::text)) % 250 <> 0")
        .bind(task_type)
        .execute(db.pool())
        .await
        .unwrap();
    sqlx::query("ANALYZE tasks")
        .execute(db.pool())
        .await
        .unwrap();
}

async fn index_bytes(harness: &Harness, index: &str) -> i64 {
    sqlx::query_scalar("SELECT pg_relation_size(to_regclass($1))")
        .bind(format!("public.{index}"))
        .fetch_one(harness.db.pool())
        .await
        .unwrap()
}

async fn rebuilds_running(harness: &Harness) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_progress_create_index
          WHERE relid = 'public.tasks'::regclass AND command = 'REINDEX CONCURRENTLY'",
    )
    .fetch_one(harness.db.pool())
    .await
    .unwrap()
}

/// Ids are UUIDv7, so `tasks_pkey` and `tasks_listed` grow at their right edge. Expiry
/// deletes whole days of settled tasks, but a leaf page that keeps one row (a dead letter)
/// is never emptied, so never reused: the indexes grew by about a day's size every day
/// while the rows stayed bounded (make soak: `tasks` 14.8 → 23.1 MiB in an hour at 26,000
/// rows). The upkeep rebuilds such an index, and writers go on while the rebuild waits for
/// a long reader.
#[tokio::test]
async fn indexes_left_sparse_by_deletes_are_rebuilt_while_submissions_go_on() {
    let spec = test_type("sparse");
    let name = spec.name.clone();
    let harness = Harness::start_with(vec![spec], |config| {
        config.upkeep = Some(UpkeepConfig {
            indexes_every: Duration::from_millis(200),
            ..fast_upkeep()
        });
    })
    .await;
    settled_tasks_in_id_order(&harness.db, &name).await;
    let before = index_bytes(&harness, "tasks_pkey").await;
    let listed_before = index_bytes(&harness, "tasks_listed").await;

    // A long reader of the table, open before the deletes: a rebuild must wait for it.
    let mut reader = sqlx::PgConnection::connect(&harness.db_url).await.unwrap();
    let mut reading = reader.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *reading)
        .await
        .unwrap();
    sqlx::query("SELECT count(*) FROM tasks")
        .execute(&mut *reading)
        .await
        .unwrap();

    // Expiry's pattern: all but one task in 250 deleted (the dead letters that stay).
    sqlx::query("DELETE FROM tasks WHERE task_type = $1 AND abs(hashtext(id::text)) % 250 <> 0")
        .bind(&name)
        .execute(harness.db.pool())
        .await
        .unwrap();
    sqlx::query("ANALYZE tasks")
        .execute(harness.db.pool())
        .await
        .unwrap();

    wait_until(
        "a rebuild of a sparse index started",
        Duration::from_secs(60),
        || async { rebuilds_running(&harness).await > 0 },
    )
    .await;
    // Writers are not held: submissions are answered while the rebuild waits for the reader.
    for _ in 0..10 {
        let (status, body) = harness.submit(&name, serde_json::json!({}), None).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
    }
    assert!(
        rebuilds_running(&harness).await > 0,
        "the rebuild did not wait for the reader"
    );
    reading.rollback().await.unwrap();

    wait_until(
        "the sparse indexes rebuilt",
        Duration::from_secs(120),
        || async {
            index_bytes(&harness, "tasks_pkey").await * 10 < before
                && index_bytes(&harness, "tasks_listed").await * 10 < listed_before
        },
    )
    .await;
    // Every rebuild done whole: no invalid copy left for writers to keep updating.
    wait_until(
        "no rebuild running and no invalid index",
        Duration::from_secs(120),
        || async {
            let invalid: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_index
                  WHERE indrelid = 'public.tasks'::regclass AND NOT indisvalid",
            )
            .fetch_one(harness.db.pool())
            .await
            .unwrap();
            invalid == 0 && rebuilds_running(&harness).await == 0
        },
    )
    .await;
    harness.shutdown().await;
}

/// A least-privilege gateway (decision 0015) does not own `tasks`, and `pg_stats` hides a
/// table under row-level security from it: it still measures the indexes (the density
/// gauge) and is told which ones only the owner may rebuild; the owner then rebuilds them.
#[tokio::test]
async fn a_role_that_does_not_own_tasks_measures_and_is_told_what_to_rebuild() {
    let test_db = TestDatabase::create().await;
    let task_type = unique_type("sparse-denied");
    settled_tasks_in_id_order(&test_db.db, &task_type).await;
    all_but_one_in_250_deleted(&test_db.db, &task_type).await;

    let role = ComponentRole::new(&format!(
        "conveyor_gw_{}",
        &Uuid::new_v4().simple().to_string()[..8]
    ))
    .unwrap();
    test_db.db.grant_gateway(&role).await.unwrap();
    let url = test_db.url.replacen(
        "conveyor:conveyor@",
        &format!("{}:{}@", role.name(), role.password()),
        1,
    );
    assert_ne!(url, test_db.url, "the test database URL names its user");
    let gateway = Db::connect(&DbOptions::new(&url)).unwrap();
    let look = gateway.upkeep_task_indexes().await.unwrap().unwrap();
    let pkey = look
        .measured
        .iter()
        .find(|index| index.name == "tasks_pkey")
        .unwrap();
    assert!(pkey.packed_bytes.is_some(), "{look:?}");
    assert!(pkey.is_sparse(), "{look:?}");
    let denied: Vec<&str> = look.denied.iter().map(|i| i.name.as_str()).collect();
    assert!(denied.contains(&"tasks_pkey"), "{look:?}");
    assert!(look.rebuilt.is_empty(), "{look:?}");
    gateway.close().await;

    let look = test_db.db.upkeep_task_indexes().await.unwrap().unwrap();
    let rebuilt: Vec<&str> = look.rebuilt.iter().map(|(b, _)| b.name.as_str()).collect();
    assert!(rebuilt.contains(&"tasks_pkey"), "{look:?}");
    assert!(look.denied.is_empty(), "{look:?}");
    for (before, after) in &look.rebuilt {
        assert!(after.bytes * 4 < before.bytes, "{before:?} → {after:?}");
    }
}
