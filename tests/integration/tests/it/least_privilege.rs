//! `conveyorctl grant`: a namespace's workers get credentials that reach only its own queues
//! and rows (issue 11, decision 0013), on the real PostgreSQL and RabbitMQ.

use std::time::Duration;

use conveyor_core::amqp;
use conveyor_core::db::{Db, DbOptions};
use conveyor_core::task_type::{NamedTaskType, TaskTypeSpec};
use conveyor_core::testing;
use conveyor_core::TaskState;
use conveyor_gateway::auth::Tokens;
use conveyor_worker::handler::Handler;
use lapin::options::BasicNackOptions;
use serde_json::json;

use crate::support::{queue, Harness, TOKEN};

/// The value of `key:` in the Secret `conveyorctl grant` printed.
fn secret_value(yaml: &str, key: &str) -> String {
    yaml.lines()
        .find_map(|line| line.trim().strip_prefix(&format!("{key}: ")))
        .unwrap_or_else(|| panic!("no {key} in\n{yaml}"))
        .to_owned()
}

#[tokio::test]
async fn a_namespaces_worker_credentials_reach_only_its_own_queues_and_rows() {
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let (mine, theirs) = (format!("lp-a-{suffix}"), format!("lp-b-{suffix}"));
    let name = testing::unique_type("transcode");
    let types = [&mine, &theirs]
        .map(|ns| NamedTaskType::in_namespace(ns, &name, TaskTypeSpec::default()))
        .to_vec();
    let (my_key, their_key) = (types[0].name.clone(), types[1].name.clone());
    let mut harness = Harness::start_with(types, |config| {
        config.tokens = Tokens::parse_pairs(&format!("tests@*={TOKEN}")).unwrap();
    })
    .await;
    let submit = |ns: &str| {
        let request = harness
            .http
            .post(format!("{}/v1/tasks", harness.gateway_url))
            .bearer_auth(TOKEN)
            .json(&json!({"taskType": name, "namespace": ns, "payload": {}}));
        async move {
            let body: serde_json::Value = request.send().await.unwrap().json().await.unwrap();
            body["id"].as_str().unwrap().parse::<uuid::Uuid>().unwrap()
        }
    };
    let (my_task, their_task) = (submit(&mine).await, submit(&theirs).await);

    let secret = harness.conveyorctl(&["grant", "-n", &mine]);
    assert!(secret.contains("kind: Secret") && secret.contains(&format!("namespace: {mine}")));
    let database_url = secret_value(&secret, "database-url");
    let amqp_url = secret_value(&secret, "amqp-url");
    assert!(
        database_url.contains(&format!("conveyor-{mine}:")),
        "{database_url}"
    );

    // Rows: only its own are there for it; it cannot make or remove tasks.
    let db = Db::connect(&DbOptions::new(&database_url)).unwrap();
    assert!(db.task(my_task).await.unwrap().is_some());
    assert!(
        db.task(their_task).await.unwrap().is_none(),
        "another namespace's row"
    );
    assert!(!db.claim(their_task, 0, "intruder").await.unwrap());
    let refused = sqlx::query("DELETE FROM tasks").execute(db.pool()).await;
    assert!(refused.is_err(), "a worker's role deleted tasks");
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM task_events WHERE task_id = $1")
        .bind(their_task)
        .fetch_one(db.pool())
        .await
        .unwrap();
    assert_eq!(events, 0, "another namespace's audit rows");

    // Queues: its own it may read; another namespace's it may not.
    let conn = amqp::connect(&amqp_url, "least-privilege-test")
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let own = amqp::get_one(&channel, &queue(&my_key).main).await.unwrap();
    let nack = BasicNackOptions {
        requeue: true,
        ..Default::default()
    };
    own.expect("its own task's message")
        .acker
        .nack(nack)
        .await
        .unwrap();
    let other = conn.create_channel().await.unwrap();
    assert!(
        amqp::get_one(&other, &queue(&their_key).main)
            .await
            .is_err(),
        "read another namespace's queue"
    );
    let _ = conn.close(200, "done").await;

    // A worker of the namespace (its pool consumes its namespace's types) runs its task
    // with these credentials alone.
    let mut config = harness.worker_config(&[&my_key], Handler::Noop, 2);
    config.database = DbOptions::new(&database_url);
    config.amqp_url = amqp_url.clone();
    config.declare_queues = false; // as the operator's pods run
    let worker = harness.start_configured(config);
    harness
        .wait_for_state(&my_key, TaskState::Completed, 1, Duration::from_secs(60))
        .await;
    assert_eq!(
        harness.db.task(their_task).await.unwrap().unwrap().state,
        TaskState::Queued
    );

    // Leave no role or user behind.
    harness.take_worker(&worker).stop().await;
    db.pool().close().await;
    let role = format!("conveyor-{mine}");
    let cleanup = [
        format!("DROP POLICY \"{role}\" ON tasks"),
        format!("DROP POLICY \"{role}\" ON task_events"),
        format!("DROP POLICY \"{role}\" ON queue_probes"),
        format!("REVOKE ALL ON tasks, task_events, queue_probes FROM \"{role}\""),
        format!("REVOKE ALL ON SEQUENCE task_events_seq_seq FROM \"{role}\""),
        format!("REVOKE ALL ON SCHEMA public FROM \"{role}\""),
        format!("DROP ROLE \"{role}\""),
    ];
    for statement in cleanup {
        sqlx::query(&statement)
            .execute(harness.db.pool())
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    let _ = testing::http_client()
        .delete(format!("{}/api/users/{role}", testing::management_url()))
        .send()
        .await;
    harness.shutdown().await;
}

/// The exec handler's environment is scrubbed, but a handler runs as its worker's user and
/// could read the worker's own environment (the database and broker URLs, with passwords)
/// in `/proc/<worker>/environ`, unless the worker is not dumpable. Run as another user than
/// root, who reads every process's environment.
#[tokio::test]
async fn a_handler_cannot_read_its_workers_environment() {
    let uid = std::process::Command::new("id").arg("-u").output().unwrap();
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        eprintln!("skipped: needs root to run the worker as another user");
        return;
    }
    let spec = crate::support::test_type("environ");
    let name = spec.name.clone();
    let harness = Harness::start(vec![spec]).await;
    let dir = std::env::temp_dir().join(format!("conveyor-environ-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(dir.join("buffers")).unwrap();
    let script = dir.join("peek.sh");
    // The handler's parent is the worker: can it read the worker's environment?
    std::fs::write(
        &script,
        "#!/bin/sh\nif grep -q CONVEYOR_DATABASE_URL /proc/$PPID/environ 2>/dev/null; \
         then echo '{\"read\": true}'; else echo '{\"read\": false}'; fi\n",
    )
    .unwrap();
    let open = |path: &std::path::Path, mode: u32| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    open(&dir, 0o755);
    open(&dir.join("buffers"), 0o777);
    open(&script, 0o755);
    let script = script.display().to_string();
    let mut worker = harness
        .worker_command(
            &[
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
            ],
            "environ",
            &[&name],
            &["--handler", "exec", "--", &script],
        )
        .env("CONVEYOR_BUFFER_DIR", dir.join("buffers"))
        .spawn()
        .expect("start conveyor-worker as nobody");
    let id = harness.submit_ok(&name, json!({})).await;
    harness
        .wait_for_state(&name, TaskState::Completed, 1, Duration::from_secs(60))
        .await;
    let task = harness.db.task(id).await.unwrap().expect("the task");
    let _ = worker.kill();
    let _ = worker.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        task.result,
        Some(json!({"read": false})),
        "{:?}",
        task.result
    );
    harness.shutdown().await;
}
