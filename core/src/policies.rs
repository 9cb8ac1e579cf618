//! The RabbitMQ policies of a task type's queues: everything about them that may change
//! after they were declared (queue arguments are fixed at declaration and would win over a
//! policy). Pure: the operator puts them through the management API, and the chaos suite
//! puts the same ones, so that every scenario runs on the production topology.

use serde::Serialize;
use serde_json::json;

use crate::amqp::QueueNames;
use crate::task_type::NamedTaskType;

/// How far the retry safety net sits above `maxRetries`: the broker parks a message in
/// remediation only after the lifecycle would have (decision 0004).
pub const DELIVERY_LIMIT_MARGIN: u32 = 2;
/// The broker refuses publishes beyond this multiple of `maxQueueDepth`; the gateway
/// answers 429 long before.
pub const HARD_LENGTH_FACTOR: u64 = 2;

/// A RabbitMQ policy, as the management API takes it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct Policy {
    #[serde(skip)]
    pub name: String,
    pub pattern: String,
    pub apply_to: &'static str,
    pub priority: i32,
    pub definition: serde_json::Value,
}

/// Names of the policies every type with default settings shares.
pub const SHARED_MAIN: &str = "conveyor-defaults";
pub const SHARED_RETRY: &str = "conveyor-defaults-retry";
/// Below a type's own policies: RabbitMQ applies the one policy of highest priority.
const SHARED_PRIORITY: i32 = 1;
const OWN_PRIORITY: i32 = 10;

/// The policies that the queues of every type with default settings share: a type costs no
/// policy write of its own unless it changes a setting. Each write makes RabbitMQ match
/// every queue of the vhost against every policy (about 2 s at 700 queues and 700 policies
/// here), which bounded a thousand types to about 20 Ready a minute (docs/operator-scale.md).
pub fn shared_policies() -> Vec<Policy> {
    let defaults = NamedTaskType::named("defaults");
    let [main, retry] = own_policies(&defaults);
    vec![
        Policy {
            name: SHARED_MAIN.to_owned(),
            // A work queue: `conveyor.<type>`, not one of its retry or remediation queues.
            pattern: r"^conveyor\.(?!.*\.(retry(\.[0-9]+)?|remediation)$)[a-z0-9_.-]+$".to_owned(),
            priority: SHARED_PRIORITY,
            ..main
        },
        Policy {
            name: SHARED_RETRY.to_owned(),
            pattern: r"^conveyor\..+\.retry(\.[0-9]+)?$".to_owned(),
            priority: SHARED_PRIORITY,
            ..retry
        },
    ]
}

/// The policies of a task type's own, for the settings in which it differs from the shared
/// ones (none for a type with default settings).
pub fn task_type_policies(task_type: &NamedTaskType) -> Vec<Policy> {
    let shared = shared_policies();
    own_policies(task_type)
        .into_iter()
        .zip(shared)
        .filter(|(own, shared)| own.definition != shared.definition)
        .map(|(own, _)| own)
        .collect()
}

/// Every policy name a type may have of its own: what deleting it, or resetting it to
/// default settings, removes.
pub fn task_type_policy_names(task_type: &NamedTaskType) -> Vec<String> {
    own_policies(task_type).map(|p| p.name).to_vec()
}

/// Everything about a type's queues that may change after they were declared: the work
/// queue's limits, the retry queues' TTL cap.
fn own_policies(task_type: &NamedTaskType) -> [Policy; 2] {
    let queues = QueueNames::of(&task_type.name);
    // Task type names are [a-z0-9_.-]: only the dot is special in a regex.
    let exact = |queue: &str| format!("^{}$", queue.replace('.', "\\."));
    [
        Policy {
            name: queues.main.clone(),
            pattern: exact(&queues.main),
            apply_to: "queues",
            priority: OWN_PRIORITY,
            definition: json!({
                "delivery-limit": task_type.max_retries + DELIVERY_LIMIT_MARGIN,
                "max-length": task_type.max_queue_depth.saturating_mul(HARD_LENGTH_FACTOR),
                "overflow": "reject-publish",
            }),
        },
        Policy {
            name: queues.retry.clone(),
            // Every retry queue: `conveyor.T.retry` and `conveyor.T.retry.<tier>`.
            pattern: format!("^{}(\\.[0-9]+)?$", queues.retry.replace('.', "\\.")),
            apply_to: "queues",
            priority: OWN_PRIORITY,
            // A cap on the per-message backoff TTL: nothing waits longer than maxSeconds.
            definition: json!({
                "message-ttl": (task_type.backoff.max_seconds * 1000.0).ceil() as u64,
            }),
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_follow_the_task_type() {
        let mut spec = NamedTaskType::named("thumbnail");
        spec.max_retries = 4;
        spec.max_queue_depth = 1000;
        spec.backoff.max_seconds = 90.0;
        let policies = task_type_policies(&spec);
        assert_eq!(policies.len(), 2);
        assert_eq!(policies[0].name, "conveyor.thumbnail");
        assert_eq!(policies[0].pattern, "^conveyor\\.thumbnail$");
        assert_eq!(policies[0].definition["delivery-limit"], 6);
        assert_eq!(policies[0].definition["max-length"], 2000);
        assert_eq!(
            policies[1].pattern,
            "^conveyor\\.thumbnail\\.retry(\\.[0-9]+)?$"
        );
        assert_eq!(policies[1].definition["message-ttl"], 90_000);
    }

    #[test]
    fn a_type_with_default_settings_has_no_policy_of_its_own() {
        assert!(task_type_policies(&NamedTaskType::named("video.thumbnail")).is_empty());
        let mut retries = NamedTaskType::named("video.thumbnail");
        retries.max_retries = 9;
        let own = task_type_policies(&retries);
        assert_eq!(own.len(), 1, "only the work queue's limits differ");
        assert_eq!(own[0].name, "conveyor.video.thumbnail");
        assert!(own[0].priority > shared_policies()[0].priority);
    }
}
