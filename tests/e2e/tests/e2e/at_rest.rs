//! What the platform asks of the apiserver while nothing changes, judged from the
//! apiserver's audit log.

use std::time::Duration;

use conveyor_e2e_tests::audit::{self, AuditLog};
use serde_json::json;

use crate::{pool_stack, MINUTE};

/// The gateway listed every TaskType and every ClientToken each refresh (every 2 s on the
/// dev stack): a request and a copy of every object each time, however few had changed. It
/// watches them now: at rest it lists nothing, and a type made meanwhile still serves.
#[tokio::test]
async fn the_gateway_at_rest_lists_nothing_and_still_takes_in_new_types() {
    let mut log = AuditLog::from_now();
    assert!(
        log.exists(),
        "no audit log of the apiserver (cluster/up.sh writes it)"
    );
    // Five of the dev gateway's refresh intervals: the old gateway listed ten times in them.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let lists: Vec<String> = log
        .new_requests()
        .into_iter()
        .filter(|r| r.user == audit::GATEWAY && r.verb == "list")
        .map(|r| r.resource)
        .collect();
    // A watch that fell too far behind lists again once; more than that is polling.
    assert!(
        lists.len() <= 1,
        "the gateway listed {} times in 10 s at rest: {lists:?}",
        lists.len()
    );

    let (stack, task_type) = pool_stack("atrest", "at-rest", "", 1).await;
    let ids = stack
        .submit_all(&task_type, vec![json!({"sleepMs": 10}); 3])
        .await;
    for id in ids {
        let task = stack.task_when_settled(id, MINUTE).await;
        assert_eq!(task["state"], "COMPLETED", "{task}");
    }
    stack.finish().await;
}
