//! Indexes of `tasks` bounded by what the table holds, not by time (issue 32, what must be
//! shown; decision 0037), on the real PostgreSQL.

use std::time::Duration;

use conveyor_core::testing::wait_until;
use conveyor_gateway::upkeep::UpkeepConfig;
use reqwest::StatusCode;
use sqlx::Connection;
use uuid::Uuid;

use crate::self_healing::fast_upkeep;
use crate::support::{test_type, Harness};

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
    // 100,000 settled tasks made in id order, as the gateway makes them.
    for _ in 0..100 {
        let ids: Vec<Uuid> = (0..1000).map(|_| Uuid::now_v7()).collect();
        sqlx::query(
            "INSERT INTO tasks (id, tenant, idempotency_key, task_type, state, payload)
             SELECT id, 'default', gen_random_uuid(), $2, 'COMPLETED', '{}'
               FROM unnest($1::uuid[]) AS id",
        )
        .bind(&ids)
        .bind(&name)
        .execute(harness.db.pool())
        .await
        .unwrap();
    }
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
