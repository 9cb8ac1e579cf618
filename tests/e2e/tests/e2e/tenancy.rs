//! Namespaces as tenants: their own credentials, their own task types, their own tokens.

use conveyor_core::testing::{self, wait_until};
use conveyor_core::TaskState;
use conveyor_e2e_tests::{assert_valid_chain, Stack};
use serde_json::json;

use crate::{pool_yaml, task_type_yaml, MINUTE};

#[tokio::test]
async fn pools_run_with_their_namespaces_granted_credentials_alone() {
    let mut stack = Stack::namespace("granted").await;
    if !stack.use_granted_credentials() {
        eprintln!("skipped: the pods reach the services by other addresses (kind)");
        stack.finish().await;
        return;
    }
    let (ok, bad) = (
        stack.task_type("e2e-granted-ok"),
        stack.task_type("e2e-granted-bad"),
    );
    stack.apply(&task_type_yaml(&ok, ""));
    stack.apply(&task_type_yaml(
        &bad,
        "  backoff: {initialSeconds: 0.2, maxSeconds: 0.5, multiplier: 2}\n",
    ));
    stack.apply(&pool_yaml("ok", &ok, "  replicas: 1\n"));
    stack.apply(&format!(
        "apiVersion: conveyor.dev/v1alpha1\nkind: WorkerPool\nmetadata: {{name: bad}}\nspec:\n  \
         taskTypes: [{bad}]\n  image: conveyor:dev\n  handler: {{type: fail}}\n  replicas: 1\n"
    ));
    stack.wait_for_workers(&ok, 1).await;
    stack.wait_for_workers(&bad, 1).await;
    let done = stack
        .submit_all(&ok, vec![json!({"sleepMs": 10}); 10])
        .await;
    let failing = stack.submit_all(&bad, vec![json!({}); 3]).await;
    stack
        .wait_for_state(&ok, TaskState::Completed, 10, MINUTE)
        .await;
    stack
        .wait_for_state(&bad, TaskState::DeadLetter, 3, MINUTE)
        .await;
    for id in done.into_iter().chain(failing.iter().copied()) {
        assert_valid_chain(&stack.events(id).await);
    }
    for id in failing {
        let retried = stack
            .events(id)
            .await
            .iter()
            .filter(|e| (e.from_state, e.to_state) == (Some(TaskState::Failed), TaskState::Queued))
            .count();
        assert_eq!(retried, 2, "task {id} retried maxRetries times");
    }
    wait_until("the dead letters parked in remediation", MINUTE, || async {
        let queue = stack.queue(&stack.queue_of(&bad, ".remediation")).await;
        queue.and_then(|q| q["messages"].as_u64()) == Some(3)
    })
    .await;
    stack.finish().await;
}

#[tokio::test]
async fn two_namespaces_with_a_type_of_one_name_work_apart_and_delete_apart() {
    let mut video = Stack::namespace("tenant-video").await;
    let mut audio = Stack::namespace("tenant-audio").await;
    let t = video.task_type("e2e-transcode");
    audio.share_task_type(&t);
    for stack in [&video, &audio] {
        stack.apply(&task_type_yaml(&t, "  deletionPolicy: Delete\n"));
    }
    // Video has workers; audio's tasks wait in its own queue.
    video.apply(&pool_yaml("transcode", &t, "  replicas: 1\n"));
    video.wait_for_workers(&t, 1).await;
    let payloads = || (0..20).map(|i| json!({ "sleepMs": i })).collect();
    video.submit_all(&t, payloads()).await;
    let waiting = audio.submit_all(&t, payloads()).await;
    video
        .wait_for_state(&t, TaskState::Completed, 20, 2 * MINUTE)
        .await;
    async fn ready(stack: &Stack, t: &str) -> Option<u64> {
        let queue = stack.queue_of(t, "");
        stack
            .queue(&queue)
            .await
            .and_then(|q| q["messages_ready"].as_u64())
    }
    wait_until("audio's 20 tasks in its own queue", MINUTE, || async {
        ready(&audio, &t).await >= Some(20)
    })
    .await;
    assert_eq!(audio.count(&t, TaskState::Completed).await, 0);

    // A TaskType named to alias audio's retry queue is refused before any finalizer, and
    // deleting it deletes nothing.
    let alias = format!("{t}.retry");
    audio.apply(&task_type_yaml(&alias, "  deletionPolicy: Delete\n"));
    wait_until("the aliasing TaskType refused", MINUTE, || async {
        audio
            .kubectl(&[
                "get",
                "tasktype",
                &alias,
                "-o",
                "jsonpath={.status.conditions[0].reason}",
            ])
            .contains("InvalidSpec")
    })
    .await;
    let finalizers = audio.kubectl(&[
        "get",
        "tasktype",
        &alias,
        "-o",
        "jsonpath={.metadata.finalizers}",
    ]);
    assert_eq!(finalizers.trim(), "", "no finalizer on a refused TaskType");
    audio.kubectl(&["delete", "tasktype", &alias]);

    // Deleting video's type (Delete) removes video's queues only.
    video.kubectl(&["delete", "tasktype", &t]);
    wait_until("video's queues deleted", MINUTE, || async {
        video.queue(&video.queue_of(&t, "")).await.is_none()
    })
    .await;
    for suffix in ["", ".retry", ".remediation"] {
        assert!(
            audio.queue(&audio.queue_of(&t, suffix)).await.is_some(),
            "audio's queue{suffix} kept"
        );
    }
    // At least its 20 tasks: the gateway's upkeep may have a probe in the queue too
    // (decision 0011).
    let kept = ready(&audio, &t).await;
    assert!(kept >= Some(20), "audio's messages kept: {kept:?} ready");
    assert_eq!(
        audio.count(&t, TaskState::Queued).await,
        waiting.len() as i64
    );
    audio.finish().await;
    video.finish().await;
}

/// A ClientToken `name` holding the digest of `token`, as a team applies it.
fn client_token(name: &str, token: &str) -> String {
    use sha2::Digest;
    let digest: String = sha2::Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!(
        "apiVersion: conveyor.dev/v1alpha1\nkind: ClientToken\nmetadata: {{name: {name}}}\n\
         spec: {{tokenSha256: {digest}}}\n"
    )
}

#[tokio::test]
async fn a_client_token_of_one_namespace_reaches_only_that_namespaces_tasks() {
    let mut mine = Stack::namespace("token-mine").await;
    let mut theirs = Stack::namespace("token-theirs").await;
    let t = mine.task_type("e2e-tokens");
    theirs.share_task_type(&t);
    for stack in [&mine, &theirs] {
        stack.apply(&task_type_yaml(&t, ""));
    }
    // The team's own token, as its digest in its own namespace (no Secret involved).
    let token = format!("team-token-{}", uuid::Uuid::new_v4());
    mine.apply(&client_token("team", &token));
    let http = testing::http_client();
    let submit = |token: String, namespace: Option<String>| {
        let http = http.clone();
        let url = format!("{}/v1/tasks", mine.gateway);
        let t = t.clone();
        async move {
            let answer = http
                .post(url)
                .bearer_auth(token)
                .json(&json!({"taskType": t, "namespace": namespace, "payload": {}}))
                .send()
                .await
                .unwrap();
            let status = answer.status();
            (
                status,
                answer.json::<serde_json::Value>().await.unwrap_or_default(),
            )
        }
    };
    // The gateway lists ClientTokens (and TaskTypes) every few seconds.
    let accepted = std::cell::RefCell::new(serde_json::Value::Null);
    wait_until(
        "the team's token accepted for its namespace",
        MINUTE,
        || async {
            let (status, body) = submit(token.clone(), None).await;
            *accepted.borrow_mut() = body;
            status == reqwest::StatusCode::CREATED
        },
    )
    .await;
    let own_id = accepted.borrow()["id"].as_str().unwrap().to_owned();
    // The admin token may use the other namespace, once the gateway has listed its type...
    wait_until("the other namespace's type served", MINUTE, || async {
        let (status, body) = submit(mine.token.clone(), Some(theirs.namespace.clone())).await;
        *accepted.borrow_mut() = body;
        status == reqwest::StatusCode::CREATED
    })
    .await;
    let their_id = accepted.borrow()["id"].as_str().unwrap().to_owned();
    // ...and the team's token may not: the same answer as for a type that does not exist.
    let (status, body) = submit(token.clone(), Some(theirs.namespace.clone())).await;
    assert_eq!(status, reqwest::StatusCode::NOT_FOUND, "{body}");
    assert_eq!(body["error"]["code"], "unknown_task_type");
    let read = |id: String| {
        let http = http.clone();
        let url = format!("{}/v1/tasks/{id}", mine.gateway);
        let token = token.clone();
        async move {
            http.get(url)
                .bearer_auth(token)
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(read(own_id.clone()).await, reqwest::StatusCode::OK);
    assert_eq!(read(their_id).await, reqwest::StatusCode::NOT_FOUND);

    // A guessable token in a ClientToken is refused when presented, with what to do
    // (issue 33, item 7): anyone in the cluster could otherwise act as this namespace.
    let weak = "password123password123".to_owned();
    mine.apply(&client_token("weak", &weak));
    let refused = std::cell::RefCell::new(serde_json::Value::Null);
    wait_until("the weak token refused as weak", MINUTE, || async {
        let (status, body) = submit(weak.clone(), None).await;
        let weak_said = body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("too weak"));
        *refused.borrow_mut() = body;
        status == reqwest::StatusCode::UNAUTHORIZED && weak_said
    })
    .await;

    // A stream opened with the token (the task waits: no pool here) stays open...
    let mut stream = http
        .get(format!("{}/v1/tasks/{own_id}/stream", mine.gateway))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), reqwest::StatusCode::OK);
    let first = stream.chunk().await.unwrap().unwrap_or_default();
    assert!(String::from_utf8_lossy(&first).contains("event: task"));

    // Deleting the ClientToken takes the token away...
    mine.kubectl(&["delete", "clienttoken", "team"]);
    wait_until("the deleted token refused", MINUTE, || async {
        submit(token.clone(), None).await.0 == reqwest::StatusCode::UNAUTHORIZED
    })
    .await;
    // ...and ends its streams (issue 33, item 3), not an hour later.
    let rest = tokio::time::timeout(MINUTE, async {
        let mut rest = String::new();
        while let Ok(Some(chunk)) = stream.chunk().await {
            rest.push_str(&String::from_utf8_lossy(&chunk));
        }
        rest
    })
    .await
    .expect("the revoked token's stream ended");
    assert!(
        rest.contains("event: error") && rest.contains("revoked"),
        "{rest}"
    );
    theirs.finish().await;
    mine.finish().await;
}
