//! The names of a task type's exchange and queues.

use crate::task::Requeue;

/// The three queue names of a task type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueNames {
    pub main: String,
    pub retry: String,
    pub remediation: String,
}

impl QueueNames {
    pub fn of(task_type: &str) -> Self {
        let main = format!("conveyor.{task_type}");
        QueueNames {
            retry: format!("{main}.retry"),
            remediation: format!("{main}.remediation"),
            main,
        }
    }

    /// The type's exchange, named as its work queue: every queue of the type is bound to it
    /// by its own name.
    pub fn exchange(&self) -> &str {
        &self.main
    }

    pub fn route(&self, route: Requeue) -> &str {
        match route {
            Requeue::Main => &self.main,
            Requeue::Retry => &self.retry,
            Requeue::Remediation => &self.remediation,
        }
    }

    /// Retry queue `tier` (see [`NamedTaskType::retry_tiers`]): the first keeps the name
    /// `conveyor.T.retry`, the others are `conveyor.T.retry.<tier>`.
    pub fn retry_tier(&self, tier: u32) -> String {
        match tier {
            0 => self.retry.clone(),
            n => format!("{}.{n}", self.retry),
        }
    }

    /// Every retry queue a type with `tiers` of them has.
    pub fn retry_queues(&self, tiers: u32) -> Vec<String> {
        (0..tiers.max(1)).map(|t| self.retry_tier(t)).collect()
    }

    /// Every queue of a type with `tiers` retry queues.
    pub fn all(&self, tiers: u32) -> Vec<String> {
        let mut all = vec![self.main.clone()];
        all.extend(self.retry_queues(tiers));
        all.push(self.remediation.clone());
        all
    }
}
