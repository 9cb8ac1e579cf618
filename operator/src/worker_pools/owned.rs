//! Which of a pool's ConfigMap, Service and PodDisruptionBudget someone else changed or
//! deleted since this operator applied them. Watches of the three kinds (metadata only,
//! `controllers.rs`) report what they see here and wake the owning pool; its reconcile
//! applies its objects again only when one of them was touched. A pool nobody touches is
//! never written to again, so repairs cost what changed, not the fleet's size.
//!
//! An object's version is its generation where it has one (a PodDisruptionBudget: the
//! disruption controller's status writes do not move it), else its resourceVersion. What
//! happened while no watch ran (a restart, a relist) is found from the first list: an
//! object missing once its kind is listed, or whose managed fields show another writer
//! newer than this operator ([`edited_since_applied`]).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::watcher;
use kube::Resource;

use crate::build::FIELD_MANAGER;
use crate::shared::lock;

/// The kinds a pool owns beside its Deployment (whose edits its generation and managed
/// fields show).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    ConfigMap,
    Service,
    PodDisruptionBudget,
}

const KINDS: usize = 3;

impl Kind {
    fn index(self) -> usize {
        match self {
            Kind::ConfigMap => 0,
            Kind::Service => 1,
            Kind::PodDisruptionBudget => 2,
        }
    }
}

/// The versions of one pool's three objects as last applied or seen, how many events each
/// kind's watch reported for it, and whether one was touched by someone else since.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Versions {
    seen: [Option<String>; KINDS],
    events: [u64; KINDS],
    touched: bool,
}

/// What was known of a pool's objects when an apply was decided.
#[derive(Debug, Clone)]
pub struct Look {
    /// One of them was touched since it was last applied, or is missing from a kind listed
    /// whole.
    pub touched: bool,
    versions: Versions,
}

#[derive(Debug, Default)]
struct State {
    pools: HashMap<String, Versions>,
    /// Each kind's first list is complete (from then on a missing object is missing).
    listed: [bool; KINDS],
    /// The pools whose object of each kind a (re)list under way has reported.
    relisting: [Option<HashSet<String>>; KINDS],
}

/// Every pool's [`Versions`], by the pool's uid.
#[derive(Debug, Default)]
pub struct Owned(Mutex<State>);

impl Owned {
    /// Takes in one event of a watch of `kind`.
    pub fn observe<K: Resource>(&self, kind: Kind, event: &watcher::Event<K>) {
        let k = kind.index();
        let mut state = lock(&self.0);
        match event {
            watcher::Event::Init => state.relisting[k] = Some(HashSet::new()),
            watcher::Event::InitApply(object) | watcher::Event::Apply(object) => {
                let Some(pool) = controller_uid(object.meta()) else {
                    return;
                };
                if let Some(listed) = state.relisting[k].as_mut() {
                    listed.insert(pool.clone());
                }
                let version = version(object.meta());
                let entry = state.pools.entry(pool).or_default();
                entry.events[k] += 1;
                let known = &mut entry.seen[k];
                let touched = match known {
                    // First sight (a restarted operator's first list, or the answer to
                    // this operator's own first apply not yet taken in).
                    None => edited_since_applied(object.meta()).is_some(),
                    Some(known) => *known != version,
                };
                *known = Some(version);
                entry.touched |= touched;
            }
            // Only pools known: the children a deleted pool's garbage collection removes
            // must not bring back the entry `forget` removed.
            watcher::Event::Delete(object) => {
                let Some(pool) = controller_uid(object.meta()) else {
                    return;
                };
                if let Some(entry) = state.pools.get_mut(&pool) {
                    entry.events[k] += 1;
                    entry.seen[k] = None;
                    entry.touched = true;
                }
            }
            // Objects known but not in the list were deleted while no watch ran.
            watcher::Event::InitDone => {
                state.listed[k] = true;
                let Some(listed) = state.relisting[k].take() else {
                    return;
                };
                for (pool, entry) in &mut state.pools {
                    if entry.seen[k].is_some() && !listed.contains(pool) {
                        entry.seen[k] = None;
                        entry.touched = true;
                    }
                }
            }
        }
    }

    /// What is known of the pool's objects now.
    pub fn look(&self, pool: &str) -> Look {
        let state = lock(&self.0);
        let versions = state.pools.get(pool).cloned().unwrap_or_default();
        let missing = (0..KINDS).any(|k| state.listed[k] && versions.seen[k].is_none());
        Look {
            touched: versions.touched || missing,
            versions,
        }
    }

    /// The pool's objects were applied, answered with these objects' metadata (`answers`).
    /// `before` is the [`Owned::look`] the apply was decided on: a kind whose watch reported
    /// something since, other than the answer (a write or a deletion by someone else after
    /// the apply), keeps the pool touched.
    pub fn applied(&self, pool: &str, before: &Look, answers: [(Kind, &ObjectMeta); 3]) {
        let mut state = lock(&self.0);
        let entry = state.pools.entry(pool.to_owned()).or_default();
        let mut touched = false;
        for (kind, answer) in answers {
            let k = kind.index();
            let answer = version(answer);
            let reported = entry.events[k] != before.versions.events[k];
            if reported && entry.seen[k].as_ref() != Some(&answer) {
                touched = true;
            } else {
                entry.seen[k] = Some(answer);
            }
        }
        entry.touched = touched;
    }

    /// The pool is gone.
    pub fn forget(&self, pool: &str) {
        lock(&self.0).pools.remove(pool);
    }
}

/// The generation where the kind has one, else the resourceVersion.
fn version(meta: &ObjectMeta) -> String {
    match meta.generation {
        Some(generation) => format!("g{generation}"),
        None => meta.resource_version.clone().unwrap_or_default(),
    }
}

fn controller_uid(meta: &ObjectMeta) -> Option<String> {
    meta.owner_references
        .as_deref()?
        .iter()
        .find(|owner| owner.controller == Some(true))
        .map(|owner| owner.uid.clone())
}

/// When another manager than this operator last wrote the object (not its status: a
/// `kubectl scale` of a Deployment is a write through its scale subresource, and counts),
/// if later than this operator's own last write: someone edited it since it was applied. Managed fields' times have second precision, so an edit within the same
/// second as an apply is not told apart from it.
pub fn edited_since_applied(meta: &ObjectMeta) -> Option<Timestamp> {
    let entries = meta.managed_fields.as_deref().unwrap_or_default();
    let writes = entries
        .iter()
        .filter(|e| e.subresource.as_deref() != Some("status"));
    let (mut ours, mut others): (Option<Timestamp>, Option<Timestamp>) = (None, None);
    for entry in writes {
        let Some(time) = entry.time.as_ref().map(|t| t.0) else {
            continue;
        };
        let latest = match entry.manager.as_deref() == Some(FIELD_MANAGER) {
            true => &mut ours,
            false => &mut others,
        };
        *latest = (*latest).max(Some(time));
    }
    others.filter(|theirs| ours.is_none_or(|ours| *theirs > ours))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
        ManagedFieldsEntry, OwnerReference, Time,
    };

    fn config_map(pool: &str, version: &str) -> ConfigMap {
        let mut map = ConfigMap::default();
        map.metadata.resource_version = Some(version.to_owned());
        map.metadata.owner_references = Some(vec![OwnerReference {
            uid: pool.to_owned(),
            controller: Some(true),
            ..OwnerReference::default()
        }]);
        map
    }

    fn written(manager: &str, second: i64, subresource: Option<&str>) -> ManagedFieldsEntry {
        ManagedFieldsEntry {
            manager: Some(manager.to_owned()),
            time: Some(Time(Timestamp::from_second(second).unwrap())),
            subresource: subresource.map(str::to_owned),
            ..ManagedFieldsEntry::default()
        }
    }

    fn answers(map: &ConfigMap) -> [(Kind, &ObjectMeta); 3] {
        [
            (Kind::ConfigMap, &map.metadata),
            (Kind::Service, &map.metadata),
            (Kind::PodDisruptionBudget, &map.metadata),
        ]
    }

    /// What the ConfigMaps' watch reports.
    fn seen(owned: &Owned, event: watcher::Event<ConfigMap>) {
        owned.observe(Kind::ConfigMap, &event);
    }

    #[test]
    fn only_another_writers_version_or_a_deletion_touches_a_pool() {
        let owned = Owned::default();
        seen(&owned, watcher::Event::InitApply(config_map("p", "5")));
        assert!(!owned.look("p").touched, "first sight, no other writer");
        seen(&owned, watcher::Event::Apply(config_map("p", "5")));
        assert!(!owned.look("p").touched, "the same version again");
        seen(&owned, watcher::Event::Apply(config_map("p", "9")));
        let before = owned.look("p");
        assert!(before.touched, "someone else's edit");
        owned.applied("p", &before, answers(&config_map("p", "9")));
        assert!(!owned.look("p").touched, "applied again");
        seen(&owned, watcher::Event::Delete(config_map("p", "9")));
        assert!(owned.look("p").touched, "deleted by hand");
        assert!(!owned.look("other").touched, "another pool is untouched");
    }

    #[test]
    fn an_edit_between_the_apply_and_its_answer_is_kept() {
        let owned = Owned::default();
        seen(&owned, watcher::Event::InitApply(config_map("p", "5")));
        seen(&owned, watcher::Event::Apply(config_map("p", "6")));
        let before = owned.look("p");
        assert!(before.touched, "edited");
        // The apply answers 7; someone else's write, 8, is seen before the answer is taken in.
        seen(&owned, watcher::Event::Apply(config_map("p", "8")));
        owned.applied("p", &before, answers(&config_map("p", "7")));
        assert!(owned.look("p").touched, "the later edit is repaired too");
        // Our own write seen before its answer costs nothing more.
        let before = owned.look("p");
        seen(&owned, watcher::Event::Apply(config_map("p", "10")));
        owned.applied("p", &before, answers(&config_map("p", "10")));
        assert!(!owned.look("p").touched);
        // Deleted by someone else after the apply answered, before the answer is taken in.
        let before = owned.look("p");
        seen(&owned, watcher::Event::Delete(config_map("p", "10")));
        owned.applied("p", &before, answers(&config_map("p", "10")));
        assert!(owned.look("p").touched, "the deletion is repaired");
    }

    #[test]
    fn what_happened_while_no_watch_ran_is_found_by_the_first_list() {
        let owned = Owned::default();
        // Edited by hand after this operator's last apply, while it was down.
        let mut edited = config_map("edited", "3");
        edited.metadata.managed_fields = Some(vec![
            written(FIELD_MANAGER, 100, None),
            written("kubectl-edit", 200, None),
        ]);
        // Only a status write by someone else since: not an edit.
        let mut status_only = config_map("status", "4");
        status_only.metadata.managed_fields = Some(vec![
            written(FIELD_MANAGER, 100, None),
            written("disruption-controller", 300, Some("status")),
        ]);
        seen(&owned, watcher::Event::Init);
        for object in [edited, status_only, config_map("kept", "2")] {
            seen(&owned, watcher::Event::InitApply(object));
        }
        seen(&owned, watcher::Event::InitDone);
        assert!(owned.look("edited").touched);
        assert!(!owned.look("status").touched);
        assert!(!owned.look("kept").touched);
        // Listed whole: a pool without its ConfigMap is missing it.
        assert!(
            owned.look("new").touched,
            "never applied, or deleted while down"
        );
        // A relist after which one ConfigMap is gone: deleted while the watch was down.
        seen(&owned, watcher::Event::Init);
        seen(&owned, watcher::Event::InitApply(config_map("status", "4")));
        seen(&owned, watcher::Event::InitDone);
        assert!(owned.look("kept").touched, "gone in the relist");
        assert!(!owned.look("status").touched);
    }

    #[test]
    fn a_deleted_pools_children_do_not_bring_it_back() {
        let owned = Owned::default();
        seen(&owned, watcher::Event::InitApply(config_map("p", "1")));
        owned.forget("p");
        seen(&owned, watcher::Event::Delete(config_map("p", "1")));
        assert!(lock(&owned.0).pools.is_empty());
    }

    #[test]
    fn objects_no_pool_controls_are_ignored() {
        let owned = Owned::default();
        let mut map = config_map("p", "1");
        map.metadata.owner_references = None;
        seen(&owned, watcher::Event::InitApply(map));
        assert!(lock(&owned.0).pools.is_empty());
    }
}
