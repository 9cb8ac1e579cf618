//! In a cluster the gateway takes its task types from the TaskType resources (here a mock
//! API server) and follows changes without a restart.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use conveyor_core::crd::{TaskType, TaskTypeSpec};
use conveyor_core::db::Locked;
use conveyor_core::task::NewTask;
use conveyor_core::task_type::NamedTaskType;
use conveyor_core::watch_scope::WatchScope;
use conveyor_core::TaskState;
use conveyor_gateway::auth::Tokens;
use conveyor_gateway::upkeep::UpkeepConfig;
use conveyor_gateway::TaskTypeSource;
use http::{Request, Response};
use kube::client::Body;
use reqwest::StatusCode;
use serde_json::json;

use crate::support::*;

/// A mock API server: lists and watches of the TaskTypes named in `types` (namespace video),
/// and of no ClientTokens. A resource version is the index of the list it stood for: a
/// watch from one waits up to a second for `types` to differ, reports the difference, and
/// ends (the client watches again from there).
fn mock_cluster(types: Arc<Mutex<Vec<String>>>) -> kube::Client {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let versions: Versions = Arc::default();
    tokio::spawn(async move {
        while let Some((request, send)) = handle.next_request().await {
            let (types, versions) = (types.clone(), versions.clone());
            tokio::spawn(async move {
                let body = answer(request.uri(), &types, &versions).await;
                send.send_response(Response::new(Body::from(body)));
            });
        }
    });
    kube::Client::new(service, "default")
}

/// Every list of names the mock has reported, by resource version.
type Versions = Arc<Mutex<Vec<Vec<String>>>>;

async fn answer(uri: &http::Uri, types: &Mutex<Vec<String>>, versions: &Versions) -> Vec<u8> {
    let path = uri.path();
    let params: Vec<&str> = uri.query().unwrap_or_default().split('&').collect();
    let watch = params.contains(&"watch=true");
    // Listed cluster-wide, or in namespace video (a gateway scoped to it).
    let path = path.replace("/namespaces/video/", "/");
    if path.ends_with("/apis/conveyor.dev/v1alpha1/clienttokens") {
        // No ClientTokens: the harness's token comes from its configuration.
        if watch {
            tokio::time::sleep(Duration::from_secs(1)).await;
            return Vec::new();
        }
        let list = json!({"apiVersion": "conveyor.dev/v1alpha1", "kind": "ClientTokenList", "metadata": {"resourceVersion": "0"}, "items": []});
        return serde_json::to_vec(&list).unwrap();
    }
    assert!(
        path.ends_with("/apis/conveyor.dev/v1alpha1/tasktypes"),
        "{path}"
    );
    if !watch {
        let names = types.lock().unwrap().clone();
        let version = version_of(versions, &names);
        let items: Vec<serde_json::Value> = names.iter().map(|n| task_type(n, version)).collect();
        let list = json!({"apiVersion": "conveyor.dev/v1alpha1", "kind": "TaskTypeList", "metadata": {"resourceVersion": version.to_string()}, "items": items});
        return serde_json::to_vec(&list).unwrap();
    }
    let from: usize = params
        .iter()
        .find_map(|p| p.strip_prefix("resourceVersion=")?.parse().ok())
        .expect("a watch from a version the mock gave");
    let known = versions.lock().unwrap()[from].clone();
    for _ in 0..20 {
        let names = types.lock().unwrap().clone();
        if names != known {
            let version = version_of(versions, &names);
            let event = |kind: &str, name: &String| {
                json!({"type": kind, "object": task_type(name, version)}).to_string()
            };
            let added = names.iter().filter(|n| !known.contains(n));
            let deleted = known.iter().filter(|n| !names.contains(n));
            let events: Vec<String> = added
                .map(|n| event("ADDED", n))
                .chain(deleted.map(|n| event("DELETED", n)))
                .collect();
            return (events.join("\n") + "\n").into_bytes();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Vec::new()
}

/// The resource version of `names`: the last one if nothing changed since, else a new one.
fn version_of(versions: &Versions, names: &[String]) -> usize {
    let mut versions = versions.lock().unwrap();
    if versions.last().map(Vec::as_slice) != Some(names) {
        versions.push(names.to_vec());
    }
    versions.len() - 1
}

fn task_type(name: &str, version: usize) -> serde_json::Value {
    let mut tt = TaskType::new(name, TaskTypeSpec::default());
    tt.metadata.namespace = Some("video".into());
    tt.metadata.resource_version = Some(version.to_string());
    serde_json::to_value(tt).unwrap()
}

#[tokio::test]
async fn the_gateway_follows_task_type_resources() {
    // TaskTypes of namespace video, as the data path keys them (`video.<name>`).
    let in_video =
        |spec: NamedTaskType| NamedTaskType::in_namespace("video", &spec.name, spec.spec);
    let (first, second) = (
        in_video(test_type("cluster")),
        in_video(test_type("cluster")),
    );
    let publisher = Harness::publisher_for_tests();
    for spec in [&first, &second] {
        publisher
            .declare_task_type(spec, Duration::from_secs(30))
            .await
            .unwrap(); // the operator's job
    }
    let listed = Arc::new(Mutex::new(vec![first.local_name().to_owned()]));
    let client = mock_cluster(listed.clone());
    let harness = Harness::start_with(vec![first.clone(), second.clone()], |config| {
        config.task_types = TaskTypeSource::Cluster {
            client,
            scope: Default::default(),
            refresh: Duration::from_millis(200),
        };
        // The harness's client belongs to namespace video.
        config.tokens = Tokens::parse_pairs(&format!("tests@video={TOKEN}")).unwrap();
    })
    .await;

    harness.submit_ok(first.local_name(), json!({})).await;
    let (status, body) = harness.submit(second.local_name(), json!({}), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");

    listed.lock().unwrap().push(second.local_name().to_owned());
    wait_until(
        "second TaskType served",
        Duration::from_secs(10),
        || async {
            harness.submit(second.local_name(), json!({}), None).await.0 == StatusCode::CREATED
        },
    )
    .await;
    harness.shutdown().await;
}

/// A gateway with upkeep following `listed` TaskTypes of namespace video (the mock cluster),
/// serving `spec`, whose queues are declared (the operator's job).
async fn upkeep_over(spec: &NamedTaskType, listed: Arc<Mutex<Vec<String>>>) -> Harness {
    Harness::publisher_for_tests()
        .declare_task_type(spec, Duration::from_secs(30))
        .await
        .unwrap();
    let client = mock_cluster(listed);
    Harness::start_with(vec![spec.clone()], |config| {
        config.task_types = TaskTypeSource::Cluster {
            client,
            scope: Default::default(),
            refresh: Duration::from_millis(200),
        };
        config.tokens = Tokens::parse_pairs(&format!("tests@video={TOKEN}")).unwrap();
        config.upkeep = Some(crate::self_healing::fast_upkeep());
    })
    .await
}

/// The TaskType is gone from the cluster: the gateway no longer takes its tasks (those it
/// took while the test waited are the type's too).
async fn wait_until_unserved(harness: &Harness, spec: &NamedTaskType) {
    wait_until(
        "the type no longer served",
        Duration::from_secs(10),
        || async {
            harness.submit(spec.local_name(), json!({}), None).await.0 == StatusCode::NOT_FOUND
        },
    )
    .await;
}

/// The owner of a claimed task died an hour ago.
async fn silence_owner(harness: &Harness, id: uuid::Uuid) {
    sqlx::query("UPDATE tasks SET heartbeat_at = now() - interval '1 hour' WHERE id = $1")
        .bind(id)
        .execute(harness.db.pool())
        .await
        .unwrap();
}

/// Deleting a TaskType under `deletionPolicy: Delete` used to leave its QUEUED and
/// PROCESSING rows open for ever, reaped, swept and listed by nothing (issue 32).
#[tokio::test]
async fn a_task_type_deleted_with_its_queues_leaves_no_open_task_behind() {
    let spec = NamedTaskType::in_namespace("video", &test_type("deleted").name, Default::default());
    let listed = Arc::new(Mutex::new(vec![spec.local_name().to_owned()]));
    let harness = upkeep_over(&spec, listed.clone()).await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(harness.submit_ok(spec.local_name(), json!({})).await);
    }
    // One is running on a pod, which dies with the type.
    assert!(harness
        .db
        .claim(ids[0], 0, "pod-of-the-deleted-pool")
        .await
        .unwrap()
        .won());

    // The operator's finalizer deletes the queues, then the TaskType goes.
    conveyor_core::testing::delete_queues(&spec.name).await;
    listed.lock().unwrap().clear();
    wait_until_unserved(&harness, &spec).await;
    silence_owner(&harness, ids[0]).await;

    wait_until("every task settled", Duration::from_secs(60), || async {
        let mut settled = true;
        for id in &ids {
            settled &= harness
                .db
                .task(*id)
                .await
                .unwrap()
                .unwrap()
                .state
                .is_settled();
        }
        settled
    })
    .await;
    for (i, id) in ids.iter().enumerate() {
        let events = harness.events(*id).await;
        conveyor_core::testing::assert_valid_chain(&events);
        let last = events.last().unwrap();
        let expected = if i == 0 {
            TaskState::DeadLetter
        } else {
            TaskState::Cancelled
        };
        assert_eq!(last.to_state, expected, "{events:?}");
        let detail = last.detail.as_deref().unwrap_or("");
        assert!(detail.contains("deleted with its queues"), "{detail}");
    }
    // The dead letter of the deleted type is still listed.
    let (status, body) = harness
        .get_json(TOKEN, "/v1/tasks?namespace=video&state=DEAD_LETTER")
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.to_string().contains(&ids[0].to_string()), "{body}");
    harness.shutdown().await;
}

/// Under `deletionPolicy: Retain` the queues and tasks wait for the type to come back: its
/// dead owners' tasks are still reaped, its tasks still listed, and a re-applied TaskType
/// runs them.
#[tokio::test]
async fn a_retained_deleted_task_type_keeps_its_tasks_reaped_listed_and_resumed() {
    let spec =
        NamedTaskType::in_namespace("video", &test_type("retained").name, Default::default());
    let listed = Arc::new(Mutex::new(vec![spec.local_name().to_owned()]));
    let mut harness = upkeep_over(&spec, listed.clone()).await;
    let running = harness.submit_ok(spec.local_name(), json!({})).await;
    let waiting = harness.submit_ok(spec.local_name(), json!({})).await;
    assert!(harness
        .db
        .claim(running, 0, "pod-that-died")
        .await
        .unwrap()
        .won());

    listed.lock().unwrap().clear();
    wait_until_unserved(&harness, &spec).await;
    silence_owner(&harness, running).await;
    // Reaped into the retained queue (the reaper trusts owners' beats only after the
    // database has answered for a whole heartbeat timeout, 30 s by default).
    wait_until(
        "the dead owner's task re-queued",
        Duration::from_secs(90),
        || async {
            let task = harness.db.task(running).await.unwrap().unwrap();
            task.state == TaskState::Queued && task.attempt == 1
        },
    )
    .await;
    for path in [
        "/v1/tasks?namespace=video".to_owned(),
        format!("/v1/tasks?namespace=video&type={}", spec.local_name()),
    ] {
        let (status, body) = harness.get_json(TOKEN, &path).await;
        assert_eq!(status, StatusCode::OK, "{path}: {body}");
        let listed: Vec<&str> = body["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|t| t["id"].as_str())
            .collect();
        for id in [running, waiting] {
            assert!(listed.contains(&id.to_string().as_str()), "{path}: {body}");
        }
    }

    // The TaskType is applied again: a worker runs both.
    listed.lock().unwrap().push(spec.local_name().to_owned());
    harness.start_worker(&[&spec.name], conveyor_worker::handler::Handler::Noop, 2);
    // Every task of the type, those the wait for the type to go submitted included.
    wait_until("every task completed", Duration::from_secs(30), || async {
        let completed = harness.count(&spec.name, TaskState::Completed).await;
        completed == harness.total_tasks(&spec.name).await
    })
    .await;
    for id in [running, waiting] {
        let task = harness.db.task(id).await.unwrap().unwrap();
        assert_eq!(task.state, TaskState::Completed, "{task:?}");
    }
    harness.shutdown().await;
}

/// A namespace-scoped gateway (decision 0048) used to take every other namespace's types for
/// retired ones (no TaskType of its own defines them) and settle their open tasks when it
/// found no queue of theirs: another install's tasks, cancelled.
#[tokio::test]
async fn a_scoped_gateways_upkeep_leaves_other_namespaces_tasks_alone() {
    let ours = NamedTaskType::in_namespace("video", &test_type("ours").name, Default::default());
    let listed = Arc::new(Mutex::new(vec![ours.local_name().to_owned()]));
    Harness::publisher_for_tests()
        .declare_task_type(&ours, Duration::from_secs(30))
        .await
        .unwrap();
    let client = mock_cluster(listed);
    let harness = Harness::start_with(vec![ours.clone()], |config| {
        config.task_types = TaskTypeSource::Cluster {
            client,
            scope: WatchScope::parse("video").unwrap(),
            refresh: Duration::from_millis(200),
        };
        config.tokens = Tokens::parse_pairs(&format!("tests@video={TOKEN}")).unwrap();
        config.upkeep = Some(UpkeepConfig {
            scope: WatchScope::parse("video").unwrap(),
            ..crate::self_healing::fast_upkeep()
        });
    })
    .await;
    // Open tasks of a type of video deleted with its queues, and of a type of another
    // namespace, whose queues are as absent from this broker.
    let gone = NamedTaskType::in_namespace("video", &test_type("gone").name, Default::default());
    let theirs =
        NamedTaskType::in_namespace("audio", &test_type("theirs").name, Default::default());
    let mut ids = Vec::new();
    for spec in [&gone, &theirs] {
        let task = NewTask {
            tenant: spec.tenant.clone(),
            ..new_task(&spec.name, uuid::Uuid::new_v4())
        };
        harness
            .db
            .record_tasks(std::slice::from_ref(&task))
            .await
            .unwrap();
        harness
            .db
            .mark_queued(&[task.id], Locked::Wait)
            .await
            .unwrap();
        ids.push(task.id);
    }
    wait_until(
        "video's retired type settled",
        Duration::from_secs(30),
        || async { harness.db.task(ids[0]).await.unwrap().unwrap().state == TaskState::Cancelled },
    )
    .await;
    // Retired looks and retention passes run every 200 ms: a few more of both.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let task = harness.db.task(ids[1]).await.unwrap().unwrap();
    assert_eq!(task.state, TaskState::Queued, "audio's task: {task:?}");
    harness.shutdown().await;
}
