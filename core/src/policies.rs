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

/// The policies of a task type's queues: everything about them that may change after
/// they were declared.
pub fn task_type_policies(task_type: &NamedTaskType) -> Vec<Policy> {
    let queues = QueueNames::of(&task_type.name);
    // Task type names are [a-z0-9_-]: nothing in them is special in a regex.
    let exact = |queue: &str| format!("^{}$", queue.replace('.', "\\."));
    vec![
        Policy {
            name: queues.main.clone(),
            pattern: exact(&queues.main),
            apply_to: "queues",
            priority: 10,
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
            priority: 10,
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
}
