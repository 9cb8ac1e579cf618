//! One hostile namespace beside a well-behaved one, on the real services (issue 33): what
//! the hostile tenant does to its own objects stays with them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use conveyor_core::amqp::{self, Outgoing, QueueNames};
use conveyor_core::db::TenantRole;
use conveyor_core::task::Requeue;
use conveyor_core::task_type::{NamedTaskType, TaskTypeSpec};
use conveyor_core::testing::{self, TestDatabase};
use conveyor_gateway::auth::Tokens;
use reqwest::StatusCode;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::{connect_as, migrated_before, queue, set_state, Harness};

const CALM: &str = "calm-tenant-token-1";
const HOSTILE: &str = "hostile-tenant-token-1";

/// A type of one name in namespaces `calm` and `hostile`, and a client of each.
async fn calm_and_hostile(extra_hostile_types: &[&str]) -> (Harness, String) {
    let name = testing::unique_type("shared");
    let mut types: Vec<NamedTaskType> = ["calm", "hostile"]
        .map(|ns| NamedTaskType::in_namespace(ns, &name, TaskTypeSpec::default()))
        .to_vec();
    for extra in extra_hostile_types {
        types.push(NamedTaskType::in_namespace(
            "hostile",
            &format!("{name}-{extra}"),
            TaskTypeSpec::default(),
        ));
    }
    let harness = Harness::start_with(types, |config| {
        config.tokens = Tokens::parse_pairs(&format!("c@calm={CALM},h@hostile={HOSTILE}")).unwrap();
        // The sweeper probes every type with queued tasks, a hostile one's too.
        config.upkeep = Some(crate::self_healing::fast_upkeep());
    })
    .await;
    (harness, name)
}

/// One submission: the status, the error code if any, and whether `Retry-After` was sent.
async fn submit(h: &Harness, token: &str, task_type: &str) -> (StatusCode, String, bool) {
    let response = h
        .http
        .post(format!("{}/v1/tasks", h.gateway_url))
        .bearer_auth(token)
        .header("Idempotency-Key", Uuid::new_v4().to_string())
        .json(&json!({"taskType": task_type, "payload": {"n": 1}}))
        .send()
        .await
        .unwrap();
    let status = response.status();
    let retry_after = response.headers().contains_key("retry-after");
    let text = response.text().await.unwrap_or_default();
    let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let code = match body["error"]["code"].as_str() {
        Some(code) => code.to_owned(),
        None => format!("(no code) {text}"),
    };
    (status, code, retry_after)
}

#[tokio::test]
async fn a_tenant_that_deletes_its_own_exchange_fails_only_its_own_submissions() {
    // Issue 33, item 1. The hostile tenant deletes its type's exchange (its broker user may
    // configure `conveyor.hostile.` objects), and the queues and exchange of a second type
    // that has tasks queued (so that it looks like a type the operator has not declared
    // yet, and the sweeper probes it), then submits to both from eight clients. Before
    // decision 0045 those publishes and probes closed the gateway's shared confirm channels
    // or reset its connection, and lapin gave their returns to other publishes: the calm
    // tenant's submissions failed with 503 naming its own queue.
    let (harness, name) = calm_and_hostile(&["undeclared"]).await;
    let hostile = QueueNames::of(&format!("hostile.{name}"));
    let undeclared = QueueNames::of(&format!("hostile.{name}-undeclared"));
    for _ in 0..20 {
        let (status, code, _) = submit(&harness, HOSTILE, &format!("{name}-undeclared")).await;
        assert_eq!(status, StatusCode::CREATED, "{code}");
    }
    let conn = amqp::connect(&testing::amqp_url(), "hostile-tenant")
        .await
        .unwrap();
    amqp::delete_exchange(&conn, &hostile).await;
    amqp::delete_queues(&conn, &undeclared.all(1)).await;
    amqp::delete_exchange(&conn, &undeclared).await;

    let harness = Arc::new(harness);
    let stop = Arc::new(AtomicBool::new(false));
    let hostile_clients: Vec<_> = (0..8)
        .map(|i| {
            let (h, stop) = (harness.clone(), stop.clone());
            let task_type = if i % 2 == 0 {
                name.clone()
            } else {
                format!("{name}-undeclared")
            };
            tokio::spawn(async move {
                let mut answers = Vec::new();
                // Bounded: the calm tenant's 1,200 decide how long this runs.
                while !stop.load(Ordering::Relaxed) && answers.len() < 1_000 {
                    answers.push((task_type.clone(), submit(&h, HOSTILE, &task_type).await));
                }
                answers
            })
        })
        .collect();
    const CLIENTS: usize = 8;
    const EACH: usize = 150;
    let calm_clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (h, name) = (harness.clone(), name.clone());
            tokio::spawn(async move {
                let mut failed = Vec::new();
                for _ in 0..EACH {
                    let (status, code, _) = submit(&h, CALM, &name).await;
                    if status != StatusCode::CREATED {
                        failed.push(format!("{status} {code}"));
                    }
                }
                failed
            })
        })
        .collect();
    let mut calm_failed = Vec::new();
    for client in calm_clients {
        calm_failed.extend(client.await.unwrap());
    }
    stop.store(true, Ordering::Relaxed);
    let mut hostile_answers = Vec::new();
    for client in hostile_clients {
        hostile_answers.extend(client.await.unwrap());
    }

    assert!(
        calm_failed.is_empty(),
        "{} of the calm tenant's {} submissions failed, e.g. {:?}",
        calm_failed.len(),
        CLIENTS * EACH,
        &calm_failed[..calm_failed.len().min(5)]
    );
    // Judged from the broker: every accepted task is in the calm tenant's queue.
    let calm_queue = queue(&format!("calm.{name}")).main;
    assert_eq!(
        harness.ready_count(&calm_queue).await,
        (CLIENTS * EACH) as u32
    );
    // The hostile tenant's own answers: the gateway does not need the type's exchange, so
    // the type whose exchange went still takes tasks; the undeclared one is refused, with
    // a code that says so and when to come back.
    let (with_queues, undeclared): (Vec<_>, Vec<_>) = hostile_answers
        .into_iter()
        .partition(|(task_type, _)| *task_type == name);
    assert!(!with_queues.is_empty() && !undeclared.is_empty());
    let other = |answers: &[(String, (StatusCode, String, bool))],
                 expected: &dyn Fn(&(StatusCode, String, bool)) -> bool| {
        answers
            .iter()
            .filter(|(_, answer)| !expected(answer))
            .take(5)
            .map(|(_, answer)| answer.clone())
            .collect::<Vec<_>>()
    };
    let refused = other(&with_queues, &|(status, _, _)| {
        *status == StatusCode::CREATED
    });
    assert!(
        refused.is_empty(),
        "the type without its exchange: {refused:?}"
    );
    let unclear = other(&undeclared, &|(status, code, retry_after)| {
        *status == StatusCode::SERVICE_UNAVAILABLE && code == "task_type_not_ready" && *retry_after
    });
    assert!(
        unclear.is_empty(),
        "of {} submissions to the undeclared type, answers other than a 503 \
         task_type_not_ready with Retry-After: {unclear:?}",
        undeclared.len()
    );
    conn.close(200, "done").await.ok();
    testing::delete_queues(&format!("calm.{name}")).await;
    testing::delete_queues(&format!("hostile.{name}")).await;
    if let Ok(harness) = Arc::try_unwrap(harness) {
        harness.shutdown().await;
    }
}

#[tokio::test]
async fn a_payload_the_database_refuses_is_refused_at_the_edge_and_alone() {
    // Issue 33, item 4. A NUL character passes JSON and schema checks, but jsonb refuses
    // it: before, it failed the whole group-committed insert, every request in it was run
    // again one by one, and its sender got 500. Now it is a 400 naming where, nothing of
    // it is recorded, and the calm tenant's submissions beside it are taken.
    let (harness, name) = calm_and_hostile(&[]).await;
    let harness = Arc::new(harness);
    let poisoned: Vec<_> = (0..4)
        .map(|i| {
            let (h, name) = (harness.clone(), name.clone());
            tokio::spawn(async move {
                let response = h
                    .http
                    .post(format!("{}/v1/tasks", h.gateway_url))
                    .bearer_auth(HOSTILE)
                    .json(&json!({"taskType": name, "payload": {"title": ["ok", format!("x\u{0}{i}")]}}))
                    .send()
                    .await
                    .unwrap();
                (response.status(), response.json::<Value>().await.unwrap())
            })
        })
        .collect();
    let calm: Vec<_> = (0..32)
        .map(|_| {
            let (h, name) = (harness.clone(), name.clone());
            tokio::spawn(async move { submit(&h, CALM, &name).await })
        })
        .collect();
    for answer in poisoned {
        let (status, body) = answer.await.unwrap();
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(body["error"]["code"], "invalid_payload", "{body}");
        assert_eq!(body["error"]["path"], "/title/1", "{body}");
    }
    for answer in calm {
        let (status, code, _) = answer.await.unwrap();
        assert_eq!(status, StatusCode::CREATED, "{code}");
    }
    assert_eq!(harness.total_tasks(&format!("hostile.{name}")).await, 0);
    assert_eq!(harness.total_tasks(&format!("calm.{name}")).await, 32);
    testing::delete_queues(&format!("calm.{name}")).await;
    testing::delete_queues(&format!("hostile.{name}")).await;
    if let Ok(harness) = Arc::try_unwrap(harness) {
        harness.shutdown().await;
    }
}

#[tokio::test]
async fn a_redrive_of_a_tenants_queue_touches_no_other_tenants_task() {
    // Issue 33, item 5. The hostile tenant publishes into its own remediation queue (its
    // broker user may write its own exchange) a message naming the calm tenant's
    // dead-lettered task. Before, an administrator's `redrive-queue` of the hostile type
    // redrove the victim's task. Now only rows of the queue's own type are acted on, and
    // the forged message is reported and dropped.
    let (harness, name) = calm_and_hostile(&[]).await;
    let response = harness
        .http
        .post(format!("{}/v1/tasks", harness.gateway_url))
        .bearer_auth(CALM)
        .json(&json!({"taskType": name, "payload": {"n": 1}}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let body: Value = response.json().await.unwrap();
    let victim: Uuid = body["id"].as_str().unwrap().parse().unwrap();
    set_state(&harness.db, victim, "DEAD_LETTER").await;
    let before = harness.events(victim).await.len();
    let mut forged = harness.db.task(victim).await.unwrap().unwrap().message();
    forged.task_type = format!("hostile.{name}");
    let published = harness
        .publisher()
        .publish(&[Outgoing {
            message: forged,
            route: Requeue::Remediation,
            delay: None,
            retry_tier: 0,
        }])
        .await;
    assert!(published.iter().all(Result::is_ok), "{published:?}");

    let stdout = harness.conveyorctl(&[
        "redrive-queue",
        "--type",
        &format!("hostile.{name}"),
        "--by",
        "ops-test",
    ]);
    assert!(stdout.contains("redriven: 0"), "{stdout}");
    assert!(
        stdout.contains("another type's task, dropped: 1"),
        "{stdout}"
    );
    let row = harness.db.task(victim).await.unwrap().unwrap();
    assert_eq!(row.state, conveyor_core::TaskState::DeadLetter);
    assert_eq!(
        harness.events(victim).await.len(),
        before,
        "no step audited"
    );
    // Judged from the broker: the calm queue holds only the task's first message.
    assert_eq!(
        harness
            .ready_count(&queue(&format!("calm.{name}")).main)
            .await,
        1
    );
    assert_eq!(
        harness
            .ready_count(&queue(&format!("hostile.{name}")).remediation)
            .await,
        0
    );
    testing::delete_queues(&format!("calm.{name}")).await;
    testing::delete_queues(&format!("hostile.{name}")).await;
    harness.shutdown().await;
}

/// What a tenant's role may do in `public`, asked over its own connection: whether it may
/// create a table there, and the `search_path` it gets.
async fn in_public_as(test: &TestDatabase, role: &str, password: &str) -> (bool, String) {
    let as_tenant = connect_as(test, role, password);
    let created = sqlx::query("CREATE TABLE public.shadow_of_tasks (id uuid)")
        .execute(as_tenant.pool())
        .await;
    if let Err(sqlx::Error::Database(err)) = &created {
        assert_eq!(err.code().as_deref(), Some("42501"), "{err}");
    }
    let path: String = sqlx::query_scalar("SHOW search_path")
        .fetch_one(as_tenant.pool())
        .await
        .unwrap();
    (created.is_ok(), path)
}

#[tokio::test]
async fn a_tenants_role_creates_nothing_in_public_even_where_postgres_14_let_everyone() {
    // Issue 33, item 6. PostgreSQL 14 and older let every role create in `public` (a
    // database upgraded from one keeps that grant): a tenant could put objects there that
    // shadow what the application calls. Granted afresh, or carried over by the migration,
    // a tenant's role creates nothing there and searches pg_catalog first.
    let test = migrated_before(20261206000002).await;
    let db = &test.db;
    sqlx::query("GRANT CREATE ON SCHEMA public TO PUBLIC")
        .execute(db.pool())
        .await
        .unwrap();
    // One role granted before the upgrade (as the grant of then made it), one after.
    let old_tenant = format!("pg14-{}", &Uuid::new_v4().simple().to_string()[..8]);
    let old = TenantRole::new(&old_tenant).unwrap();
    for statement in [
        format!(
            "CREATE ROLE \"{}\" LOGIN PASSWORD '{}'",
            old.name(),
            old.password()
        ),
        format!("GRANT USAGE ON SCHEMA public TO \"{}\"", old.name()),
        format!("GRANT SELECT ON tasks TO \"{}\"", old.name()),
    ] {
        sqlx::query(&statement).execute(db.pool()).await.unwrap();
    }
    let old_before = in_public_as(&test, old.name(), old.password()).await;
    sqlx::query("DROP TABLE IF EXISTS public.shadow_of_tasks")
        .execute(db.pool())
        .await
        .unwrap();
    let migrated = db.migrate().await;
    let new_tenant = format!("pg14-{}", &Uuid::new_v4().simple().to_string()[..8]);
    let new = TenantRole::new(&new_tenant).unwrap();
    let granted = db.grant_tenant(&new).await;
    let old_after = in_public_as(&test, old.name(), old.password()).await;
    let new_after = in_public_as(&test, new.name(), new.password()).await;
    // The roles go whatever happened (roles outlive the test's database).
    let _ = sqlx::query("DROP TABLE IF EXISTS public.shadow_of_tasks")
        .execute(db.pool())
        .await;
    db.revoke_tenant(&new_tenant).await.unwrap();
    for statement in [
        format!("REVOKE ALL ON tasks FROM \"{}\"", old.name()),
        format!("REVOKE ALL ON SCHEMA public FROM \"{}\"", old.name()),
        format!("DROP ROLE \"{}\"", old.name()),
    ] {
        sqlx::query(&statement).execute(db.pool()).await.unwrap();
    }

    assert!(
        old_before.0,
        "the PostgreSQL 14 default is in place before the upgrade"
    );
    migrated.expect("the migration applies");
    granted.expect("the grant applies");
    assert_eq!(
        old_after,
        (false, "pg_catalog, public".to_owned()),
        "migrated"
    );
    assert_eq!(
        new_after,
        (false, "pg_catalog, public".to_owned()),
        "granted"
    );
}

/// A read of a missing queue closes the gateway's depth-and-readiness channel (a 404): a
/// read of another tenant's queue on that channel at the same moment used to fail as
/// "broker unavailable" and reset the connection, failing the readiness probe (the gateway
/// out of its Service, for every tenant) and the other tenants' depth polls.
#[tokio::test]
async fn a_tenants_missing_queue_fails_no_other_read_of_the_observer() {
    let calm = NamedTaskType::in_namespace(
        "calm",
        &testing::unique_type("depth"),
        TaskTypeSpec::default(),
    );
    Harness::publisher_for_tests()
        .declare_task_type(&calm, std::time::Duration::from_secs(30))
        .await
        .unwrap();
    let present = QueueNames::of(&calm.name).main;
    let missing = QueueNames::of(&format!("hostile.{}", testing::unique_type("gone"))).main;
    let observer = Arc::new(amqp::QueueObserver::new(
        testing::amqp_url(),
        "observer-test",
    ));
    let mut failed = Vec::new();
    for _ in 0..200 {
        let (gone, there) = tokio::join!(
            observer.ready_count(&missing),
            observer.ready_count(&present)
        );
        assert!(
            matches!(gone, Err(amqp::AmqpError::NoQueue { .. })),
            "{gone:?}"
        );
        if let Err(err) = there {
            failed.push(err.to_string());
        }
    }
    testing::delete_queues(&calm.name).await;
    assert!(
        failed.is_empty(),
        "{} of 200 reads of a present queue failed: {:?}",
        failed.len(),
        failed.first()
    );
    assert_eq!(
        observer.connections_opened(),
        1,
        "the observer's connection was reset"
    );
}
