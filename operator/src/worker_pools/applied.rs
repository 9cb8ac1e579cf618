//! Whether a pool's objects need applying: only when what would be applied changed, or
//! when someone else edited the Deployment (its generation moved, or its managed fields
//! show another writer newer than this operator); edits of the ConfigMap, Service and
//! PodDisruptionBudget are seen by their watches (`owned.rs`). The fingerprint
//! of what was applied is written on the Deployment ([`APPLIED_ANNOTATION`]), so that a
//! restarted or newly elected operator applies again only what changed, not every pool of
//! the cluster.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::jiff::Timestamp;

use super::owned::edited_since_applied;
use crate::build::{fnv1a, PoolObjects};
use crate::context::Applied;

/// The Deployment's annotation naming the fingerprint of the objects last applied.
pub const APPLIED_ANNOTATION: &str = "conveyor.dev/applied";

/// A stable hash of the four objects, written on the Deployment as [`APPLIED_ANNOTATION`].
pub fn stamp(objects: &mut PoolObjects) -> u64 {
    let texts = [
        serde_json::to_string(&objects.config_map),
        serde_json::to_string(&objects.service),
        serde_json::to_string(&objects.pod_disruption_budget),
        serde_json::to_string(&objects.deployment),
    ];
    let print = fnv1a(
        texts
            .iter()
            .flat_map(|t| t.as_deref().unwrap_or_default().bytes().chain([0])),
    );
    objects
        .deployment
        .metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(APPLIED_ANNOTATION.to_owned(), format!("{print:016x}"));
    print
}

/// The fingerprint a Deployment carries, if any.
pub fn carried(deployment: &Deployment) -> Option<u64> {
    let text = deployment
        .metadata
        .annotations
        .as_ref()?
        .get(APPLIED_ANNOTATION)?;
    u64::from_str_radix(text, 16).ok()
}

/// What the Deployment looks like now.
#[derive(Debug, Clone, Copy, Default)]
pub struct Live {
    pub generation: Option<i64>,
    /// Its [`APPLIED_ANNOTATION`].
    pub carried: Option<u64>,
    /// Another writer's latest write since this operator's own ([`edited_since_applied`]).
    pub edited: Option<Timestamp>,
}

impl Live {
    pub fn of(deployment: Option<&Deployment>) -> Self {
        Live {
            generation: deployment.and_then(|d| d.metadata.generation),
            carried: deployment.and_then(carried),
            edited: deployment.and_then(|d| edited_since_applied(&d.metadata)),
        }
    }
}

/// Whether `fingerprint` needs no apply for the pool. With no memory of the pool (a
/// restarted operator), a Deployment carrying the same fingerprint, and edited by no one
/// since, counts as applied now, and is remembered in `memory` as such. An edit that an
/// apply already answered (another writer's field that the apply leaves alone, such as
/// `kubectl rollout restart`'s annotation) does not count again.
pub fn unchanged(memory: &mut Option<Applied>, live: Live, fingerprint: u64) -> bool {
    match memory {
        Some(last) => {
            last.fingerprint == fingerprint
                && last.generation.is_some()
                && last.generation == live.generation
                && live.edited <= last.edited
        }
        None if live.carried == Some(fingerprint)
            && live.generation.is_some()
            && live.edited.is_none() =>
        {
            *memory = Some(Applied {
                fingerprint,
                generation: live.generation,
                edited: None,
            });
            true
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(generation: i64, carried: u64) -> Live {
        Live {
            generation: Some(generation),
            carried: Some(carried),
            edited: None,
        }
    }

    #[test]
    fn a_restarted_operator_trusts_the_fingerprint_the_deployment_carries() {
        let mut memory = None;
        assert!(unchanged(&mut memory, live(4, 7), 7));
        let remembered = memory.as_ref().expect("remembered");
        assert_eq!(
            (remembered.fingerprint, remembered.generation),
            (7, Some(4))
        );
        assert!(unchanged(&mut memory, live(4, 7), 7), "still unchanged");
        assert!(
            !unchanged(&mut memory, live(5, 7), 7),
            "edited by someone else since"
        );
        let mut memory = None;
        assert!(!unchanged(&mut memory, live(4, 6), 7), "the spec changed");
        assert!(memory.is_none());
        assert!(!unchanged(&mut memory, Live::default(), 7), "no Deployment");
    }

    #[test]
    fn a_deployment_edited_by_someone_else_is_applied_again_once() {
        let at = |second| Some(Timestamp::from_second(second).unwrap());
        let edited = Live {
            edited: at(200),
            ..live(4, 7)
        };
        let mut memory = None;
        assert!(
            !unchanged(&mut memory, edited, 7),
            "edited while no operator ran"
        );
        // The apply answered that edit: it counts no more, until a newer one.
        let mut memory = Some(Applied {
            fingerprint: 7,
            generation: Some(4),
            edited: at(200),
        });
        assert!(unchanged(&mut memory, edited, 7));
        let later = Live {
            edited: at(300),
            ..edited
        };
        assert!(!unchanged(&mut memory, later, 7));
    }
}
