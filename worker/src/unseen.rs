//! Deliveries whose task this worker's database role cannot see. Row-level security hides
//! another namespace's rows (a pool given the wrong Secret), and a hidden row looks to the
//! claim like no row at all. Such a delivery goes back to the queue, and the worker reports
//! itself not ready, with the reason, until it sees a task of that type again.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use uuid::Uuid;

#[derive(Clone, Default)]
pub struct Unseen {
    /// The last unseen task of each type, by type.
    by_type: Arc<Mutex<BTreeMap<String, Uuid>>>,
}

impl Unseen {
    pub fn hidden(&self, task_type: &str, id: Uuid) {
        self.lock().insert(task_type.to_owned(), id);
    }

    pub fn seen(&self, task_type: &str) {
        self.lock().remove(task_type);
    }

    /// What the readiness check says while some type's tasks are hidden.
    pub fn problem(&self) -> Option<String> {
        let by_type = self.lock();
        let (task_type, id) = by_type.iter().next()?;
        Some(format!(
            "the database does not show this worker task {id} of type {task_type} (and {} \
             other types): its database role belongs to another namespace, or the row is \
             gone; check the pool's database Secret. The deliveries go back to the queue.",
            by_type.len() - 1
        ))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Uuid>> {
        self.by_type.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_type_is_a_problem_until_one_of_its_tasks_is_seen() {
        let unseen = Unseen::default();
        assert_eq!(unseen.problem(), None);
        let id = Uuid::new_v4();
        unseen.hidden("video.transcode", id);
        unseen.seen("video.thumbnail");
        let problem = unseen.problem().expect("a problem");
        assert!(problem.contains(&id.to_string()) && problem.contains("video.transcode"));
        unseen.seen("video.transcode");
        assert_eq!(unseen.problem(), None);
    }
}
