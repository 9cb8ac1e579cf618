//! The hot path's multi-row statements (decision 0016): each row fenced on its own, no
//! deadlock between concurrent ones, and one caller's bad input failing only that caller.

use std::time::Duration;

use conveyor_core::db::{Claim, Claimed, Completion, Db, DbOptions, Fence, Locked, QueuedMarks};
use conveyor_core::metrics::Metrics;
use conveyor_core::task::NewTask;
use conveyor_core::testing::{self, unique_type, TestDatabase};
use conveyor_core::TaskState::*;
use uuid::Uuid;

/// `n` new tasks of `task_type` in tenant `default`, with time-ordered ids as the gateway's.
fn new_tasks(task_type: &str, n: usize) -> Vec<NewTask> {
    (0..n)
        .map(|i| {
            let id = Uuid::now_v7();
            NewTask {
                id,
                tenant: "default".into(),
                idempotency_key: id,
                task_type: task_type.to_owned(),
                payload: serde_json::json!({ "n": i }),
                labels: Default::default(),
                trace_id: None,
            }
        })
        .collect()
}

async fn recorded(n: usize) -> (Db, String, Vec<Uuid>) {
    let db = TestDatabase::create().await.db;
    let task_type = unique_type("grouped");
    let tasks = new_tasks(&task_type, n);
    db.record_tasks(&tasks).await.unwrap();
    (db, task_type, tasks.iter().map(|t| t.id).collect())
}

fn claim(id: Uuid, attempt: i32) -> Claim {
    Claim { id, attempt }
}

fn done(id: Uuid, owner: &str) -> Completion {
    Completion {
        fence: Fence {
            id,
            attempt: 0,
            owner: owner.to_owned(),
        },
        result: serde_json::json!({ "ok": true }),
    }
}

#[tokio::test]
async fn one_claim_or_completion_statement_fences_each_row_on_its_own() {
    let (db, _, ids) = recorded(3).await;
    let (a, b, c) = (ids[0], ids[1], ids[2]);
    let claims = [
        claim(a, 0),
        claim(b, 1), // a stale (or future) attempt
        claim(a, 0), // the same delivery twice: only one can win
        claim(c, 0),
        claim(Uuid::new_v4(), 0), // no such task
    ];
    let won = db.claim_all(&claims, "w").await.unwrap();
    use Claimed::*;
    assert_eq!(won, [Won, Redundant, Redundant, Won, Unseen]);

    let completions = [done(a, "w"), done(c, "someone-else"), done(a, "w")];
    let completed = db.complete_all(&completions).await.unwrap();
    assert_eq!(completed, [true, false, false]);

    let state = |id| {
        let db = db.clone();
        async move { db.task(id).await.unwrap().unwrap().state }
    };
    assert_eq!(
        (state(a).await, state(b).await, state(c).await),
        (Completed, Ingested, Processing)
    );
    let chain = db.events(a).await.unwrap();
    testing::assert_valid_chain(&chain);
    assert_eq!(
        testing::states(&chain),
        [Ingested, Queued, Claimed, Processing, Completed]
    );
}

/// Claims from two workers and QUEUED updates over the same rows, in opposite orders, all
/// at once: every multi-row statement locks in id order, so none is chosen as a deadlock
/// victim, and each task is claimed exactly once.
#[tokio::test]
async fn concurrent_claims_and_queued_updates_never_deadlock() {
    let (db, _, ids) = recorded(400).await;
    let reversed: Vec<Uuid> = ids.iter().rev().copied().collect();
    let mut rounds = Vec::new();
    for chunk in 0..8 {
        let forward: Vec<Uuid> = ids[chunk * 50..(chunk + 1) * 50].to_vec();
        let backward: Vec<Uuid> = reversed[(7 - chunk) * 50..(8 - chunk) * 50].to_vec();
        let (db1, db2, db3, db4) = (db.clone(), db.clone(), db.clone(), db.clone());
        let (f1, b1) = (forward.clone(), backward.clone());
        rounds.push(tokio::spawn(async move {
            let claims: Vec<Claim> = f1.iter().map(|&id| claim(id, 0)).collect();
            db1.claim_all(&claims, "w1").await
        }));
        rounds.push(tokio::spawn(async move {
            let claims: Vec<Claim> = b1.iter().map(|&id| claim(id, 0)).collect();
            db2.claim_all(&claims, "w2").await
        }));
        rounds.push(tokio::spawn(async move {
            db3.mark_queued(&backward, Locked::Skip)
                .await
                .map(|()| Vec::new())
        }));
        rounds.push(tokio::spawn(async move {
            db4.mark_queued(&forward, Locked::Skip)
                .await
                .map(|()| Vec::new())
        }));
    }
    let mut claimed = 0;
    for round in rounds {
        let won = round
            .await
            .unwrap()
            .expect("no statement failed (no deadlock)");
        claimed += won.into_iter().filter(|w| w.won()).count();
    }
    assert_eq!(claimed, ids.len(), "each task claimed exactly once");
}

/// A result the database refuses (a NUL character in JSON) fails its own completion only,
/// even when it shares a statement with others.
#[tokio::test]
async fn a_refused_result_fails_only_its_own_completion() {
    let (db, _, ids) = recorded(6).await;
    let claims: Vec<Claim> = ids.iter().map(|&id| claim(id, 0)).collect();
    assert!(db
        .claim_all(&claims, "w")
        .await
        .unwrap()
        .into_iter()
        .all(Claimed::won));
    let writes = db.owner_writes("w", None);
    let calls = ids.iter().enumerate().map(|(i, &id)| {
        let writes = writes.clone();
        let mut completion = done(id, "w");
        if i == 2 {
            completion.result = serde_json::json!({ "log": "bad\u{0}byte" });
        }
        async move { writes.complete(completion).await }
    });
    let answers = futures_util::future::join_all(calls).await;
    for (i, answer) in answers.iter().enumerate() {
        match (i, answer) {
            (2, Err(err)) => assert!(err.is_data_rejected(), "{err}"),
            (2, Ok(_)) => panic!("a NUL in JSON was stored"),
            (_, Ok(true)) => {}
            (_, other) => panic!("completion {i}: {other:?}"),
        }
    }
    assert_eq!(
        db.task(ids[2]).await.unwrap().unwrap().state,
        Processing,
        "the refused one is still its owner's to fail"
    );
}

/// The gateway's QUEUED marks (decision 0020): written after the answer, at once for a task
/// a reader asks about, never a second time for a task a claim moved on first, and for every
/// other confirmed task by the writer itself.
#[tokio::test]
async fn queued_marks_follow_the_answer_and_a_claim_that_came_first_is_not_marked_again() {
    let (db, _, ids) = recorded(4).await;
    let (read, claimed, idle, held) = (ids[0], ids[1], ids[2], ids[3]);
    let state = |id| {
        let db = db.clone();
        async move { db.task(id).await.unwrap().unwrap().state }
    };
    // A writer that would wait an hour: only `settle` and `flush` write here.
    let marks = QueuedMarks::spawn(db.clone(), Metrics::new(), Duration::from_secs(3600));
    marks.confirmed(ids.clone());
    assert!(ids.iter().all(|&id| marks.is_pending(id)));
    assert_eq!(state(read).await, Ingested, "the answer path wrote no mark");

    // A reader's task is marked before its read.
    marks.settle(read).await.unwrap();
    assert!(!marks.is_pending(read));
    assert_eq!(state(read).await, Queued);
    assert_eq!(
        testing::states(&db.events(read).await.unwrap()),
        [Ingested, Queued]
    );

    // A reader's task whose row another transaction holds (a claim in flight, say): the
    // mark waits for that commit instead of skipping the row, so the read still follows it.
    let mut holder = db.pool().begin().await.unwrap();
    sqlx::query("SELECT id FROM tasks WHERE id = $1 FOR UPDATE")
        .bind(held)
        .execute(&mut *holder)
        .await
        .unwrap();
    let settling = tokio::spawn({
        let marks = marks.clone();
        async move { marks.settle(held).await }
    });
    testing::wait_until(
        "the reader's mark waiting for the row lock",
        Duration::from_secs(30),
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE wait_event_type = 'Lock' AND query LIKE '%FOR UPDATE%'
                   AND datname = current_database()",
            )
            .fetch_one(db.pool())
            .await
            .unwrap()
                > 0
        },
    )
    .await;
    holder.commit().await.unwrap();
    settling.await.unwrap().unwrap();
    assert_eq!(state(held).await, Queued);

    // A claim that comes first writes INGESTED → QUEUED itself; the mark then finds it moved on.
    assert_eq!(
        db.claim_all(&[claim(claimed, 0)], "w").await.unwrap(),
        [Claimed::Won]
    );
    marks.flush().await;
    assert!(!marks.is_pending(claimed) && !marks.is_pending(idle));
    let chain = db.events(claimed).await.unwrap();
    testing::assert_valid_chain(&chain);
    assert_eq!(
        testing::states(&chain),
        [Ingested, Queued, Claimed, Processing]
    );
    assert_eq!(state(idle).await, Queued);

    // The writer's own round marks what waited, with no reader and no flush.
    let (db2, _, later) = recorded(2).await;
    let marks = QueuedMarks::spawn(db2.clone(), Metrics::new(), Duration::from_millis(50));
    marks.confirmed(later.clone());
    testing::wait_until(
        "both confirmed tasks marked QUEUED by the writer",
        Duration::from_secs(30),
        || async {
            let mut queued = 0;
            for &id in &later {
                queued += usize::from(db2.task(id).await.unwrap().unwrap().state == Queued);
            }
            queued == later.len()
        },
    )
    .await;
}

/// The hot statements keep to the primary key whatever size `tasks` had when their plan was
/// made: a plan cached on a small table (a fresh database) scanned the whole table for every
/// claim and completion long after it had grown.
#[tokio::test]
async fn hot_statements_planned_on_a_small_table_do_not_scan_it_once_it_has_grown() {
    let test = TestDatabase::create().await;
    // Autovacuum's ANALYZE would re-plan at its own moment; this test decides when stats move.
    sqlx::query("ALTER TABLE tasks SET (autovacuum_enabled = false)")
        .execute(test.db.pool())
        .await
        .unwrap();
    // The migrations' index builds count as scans of `tasks`, and their backend reports them
    // when it gets to it: once it has exited, it has (a backend flushes its counters before
    // it leaves `pg_stat_activity`), and no scan but this test's own can land later.
    test.db.close().await;
    let watcher = Db::connect(&DbOptions {
        max_connections: 1,
        ..DbOptions::new(&test.url)
    })
    .unwrap();
    testing::wait_until(
        "the migrating connections have left",
        Duration::from_secs(60),
        || async {
            let others: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND backend_type = 'client backend'
                     AND pid <> pg_backend_pid()",
            )
            .fetch_one(watcher.pool())
            .await
            .unwrap();
            others == 0
        },
    )
    .await;
    // One connection, so that the plans made now are the ones used later.
    let db = Db::connect(&DbOptions {
        max_connections: 1,
        ..DbOptions::new(&test.url)
    })
    .unwrap();
    let task_type = unique_type("planned");
    let first = new_tasks(&task_type, 2);
    db.record_tasks(&first).await.unwrap();
    sqlx::query("ANALYZE tasks")
        .execute(db.pool())
        .await
        .unwrap();
    let run_one = |id: Uuid| {
        let db = db.clone();
        async move {
            assert_eq!(
                db.claim_all(&[claim(id, 0)], "w").await.unwrap(),
                [Claimed::Won]
            );
            assert_eq!(db.complete_all(&[done(id, "w")]).await.unwrap(), [true]);
        }
    };
    // Planned now, on a table of two rows.
    run_one(first[0].id).await;

    for _ in 0..10 {
        db.record_tasks(&new_tasks(&task_type, 2_000))
            .await
            .unwrap();
    }
    // Counters reach the view when a session flushes them (at most once a second, or when
    // idle): wait for the inserts' and then for the claim's and completion's own.
    let counters = || async {
        sqlx::query_as::<_, (i64, i64, i64)>(
            "SELECT seq_scan, n_tup_ins, n_tup_upd FROM pg_stat_user_tables
             WHERE relname = 'tasks'",
        )
        .fetch_one(watcher.pool())
        .await
        .unwrap()
    };
    let flushed = |inserted: i64, updated: i64| async move {
        testing::wait_until(
            &format!("{inserted} inserts and {updated} updates of tasks counted"),
            Duration::from_secs(60),
            || async {
                let (_, ins, upd) = counters().await;
                ins >= inserted && upd >= updated
            },
        )
        .await;
    };
    flushed(20_002, 2).await;
    let (before, _, _) = counters().await;
    run_one(first[1].id).await;
    flushed(20_002, 4).await;
    let (after, _, _) = counters().await;
    assert_eq!(after, before, "a claim or completion scanned tasks");
}
