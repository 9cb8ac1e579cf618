//! In a cluster the gateway takes its task types from the TaskType resources (here a mock
//! API server) and follows changes without a restart.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use conveyor_core::crd::{TaskType, TaskTypeSpec};
use conveyor_core::task_type::NamedTaskType;
use conveyor_gateway::auth::Tokens;
use conveyor_gateway::TaskTypeSource;
use http::{Request, Response};
use kube::client::Body;
use reqwest::StatusCode;
use serde_json::json;

use crate::support::*;

/// Answers with the current list of TaskTypes, and no ClientTokens.
fn mock_cluster(types: Arc<Mutex<Vec<String>>>) -> kube::Client {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    tokio::spawn(async move {
        while let Some((request, send)) = handle.next_request().await {
            let path = request.uri().path().to_owned();
            let list = if path.ends_with("/apis/conveyor.dev/v1alpha1/clienttokens") {
                // No ClientTokens: the harness's token comes from its configuration.
                json!({"apiVersion": "conveyor.dev/v1alpha1", "kind": "ClientTokenList", "metadata": {}, "items": []})
            } else {
                assert!(
                    path.ends_with("/apis/conveyor.dev/v1alpha1/tasktypes"),
                    "{path}"
                );
                let items: Vec<serde_json::Value> = types
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|name| {
                        let mut tt = TaskType::new(name, TaskTypeSpec::default());
                        tt.metadata.namespace = Some("video".into());
                        serde_json::to_value(tt).unwrap()
                    })
                    .collect();
                json!({"apiVersion": "conveyor.dev/v1alpha1", "kind": "TaskTypeList", "metadata": {}, "items": items})
            };
            send.send_response(Response::new(Body::from(
                serde_json::to_vec(&list).unwrap(),
            )));
        }
    });
    kube::Client::new(service, "default")
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
