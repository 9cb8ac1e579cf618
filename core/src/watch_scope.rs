//! Which namespaces a process watches: the whole cluster (ClusterRoles), or a listed few
//! (Roles in each, the namespace-scoped install; decision 0048). The operator and the
//! gateway read every resource through a [`WatchScope`], so a scoped install never sends the
//! apiserver a request its Roles would refuse.
//!
//! The apiserver has no watch of "these namespaces": a scope of several runs one watch per
//! namespace and merges them into one stream that looks like a single watch to a reflector
//! (one initial list, then changes), see [`Merged`].

use std::collections::{BTreeMap, BTreeSet, HashMap};

use futures_util::stream::{BoxStream, StreamExt};
use kube::api::{Api, ListParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Resource, ResourceExt};

/// The namespaces whose resources a process reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum WatchScope {
    /// Every namespace (cluster-wide list and watch).
    #[default]
    Cluster,
    /// Only these (one list and watch in each); never empty.
    Namespaces(BTreeSet<String>),
}

/// The bounds a watched resource needs.
pub trait Watched:
    Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
    + Clone
    + std::fmt::Debug
    + serde::de::DeserializeOwned
    + Send
    + Sync
    + 'static
{
}

impl<K> Watched for K where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static
{
}

impl WatchScope {
    /// The scope of a `--watch-namespaces` value: empty for the cluster, else namespaces
    /// separated by commas (each a DNS label).
    pub fn parse(value: &str) -> Result<WatchScope, String> {
        let mut namespaces = BTreeSet::new();
        for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if !is_dns_label(name) {
                return Err(format!(
                    "--watch-namespaces: {name:?} is not a namespace name (lowercase letters, \
                     digits and '-', at most 63)"
                ));
            }
            namespaces.insert(name.to_owned());
        }
        Ok(match namespaces.is_empty() {
            true => WatchScope::Cluster,
            false => WatchScope::Namespaces(namespaces),
        })
    }

    /// Whether `namespace` is in scope.
    pub fn covers(&self, namespace: &str) -> bool {
        match self {
            WatchScope::Cluster => true,
            WatchScope::Namespaces(names) => names.contains(namespace),
        }
    }

    /// For log lines: `cluster` or the namespaces.
    pub fn describe(&self) -> String {
        match self {
            WatchScope::Cluster => "cluster".to_owned(),
            WatchScope::Namespaces(names) => names.iter().cloned().collect::<Vec<_>>().join(","),
        }
    }

    /// Every `K` in scope, listed (one request per namespace of a scope).
    pub async fn list<K: Watched>(
        &self,
        client: &kube::Client,
        params: &ListParams,
    ) -> Result<Vec<K>, kube::Error> {
        match self {
            WatchScope::Cluster => Ok(Api::<K>::all(client.clone()).list(params).await?.items),
            WatchScope::Namespaces(names) => {
                let mut items = Vec::new();
                for name in names {
                    let api = Api::<K>::namespaced(client.clone(), name);
                    items.extend(api.list(params).await?.items);
                }
                Ok(items)
            }
        }
    }

    /// A watch of every `K` in scope, each object passed through `slim` first (what is
    /// dropped there is kept nowhere), with kube's default backoff after a failure: for a
    /// scope of namespaces, one watch each, merged so that a reflector fed by it holds
    /// every namespace's objects (see [`Merged`]).
    pub fn watch<K: Watched>(
        &self,
        client: &kube::Client,
        config: watcher::Config,
        slim: impl Fn(&mut K) + Clone + Send + 'static,
    ) -> BoxStream<'static, Result<watcher::Event<K>, watcher::Error>> {
        match self {
            WatchScope::Cluster => watcher(Api::<K>::all(client.clone()), config)
                .default_backoff()
                .modify(slim)
                .boxed(),
            WatchScope::Namespaces(names) => {
                let watches = names.iter().map(|name| {
                    let name = name.clone();
                    watcher(Api::<K>::namespaced(client.clone(), &name), config.clone())
                        .default_backoff()
                        .modify(slim.clone())
                        .map(move |event| (name.clone(), event))
                        .boxed()
                });
                let mut merged = Merged::new(names.iter().cloned());
                futures_util::stream::select_all(watches)
                    .flat_map(move |(namespace, event)| {
                        futures_util::stream::iter(merged.take(&namespace, event))
                    })
                    .boxed()
            }
        }
    }
}

/// Whether `name` is an RFC 1123 label, as a namespace's name is.
fn is_dns_label(name: &str) -> bool {
    name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// Several namespaces' watches as one. A reflector takes `Init … InitDone` as "replace
/// everything", so each namespace's own (re)list cannot be passed on as it is: the second
/// namespace's `InitDone` would drop the first's objects. Until every namespace has listed
/// once, nothing is passed on; then one `Init`, every object, one `InitDone`. After that, a
/// namespace's relist (a watch that fell behind) is passed on as the changes it amounts to:
/// each listed object applied, each one it no longer lists deleted. To know which ones it
/// no longer lists, it keeps the last (slimmed) version of each object: a second copy beside
/// the reflector's.
struct Merged<K> {
    /// The objects each namespace's watch last reported, by name.
    known: BTreeMap<String, HashMap<String, K>>,
    /// A namespace's relist under way: the objects listed so far.
    listing: BTreeMap<String, HashMap<String, K>>,
    /// Namespaces yet to finish their first list.
    unlisted: BTreeSet<String>,
}

impl<K: Resource + Clone> Merged<K> {
    fn new(namespaces: impl Iterator<Item = String>) -> Merged<K> {
        let unlisted: BTreeSet<String> = namespaces.collect();
        Merged {
            known: unlisted
                .iter()
                .map(|n| (n.clone(), HashMap::new()))
                .collect(),
            listing: BTreeMap::new(),
            unlisted,
        }
    }

    /// What `namespace`'s `event` passes on to the merged stream.
    fn take(
        &mut self,
        namespace: &str,
        event: Result<watcher::Event<K>, watcher::Error>,
    ) -> Vec<Result<watcher::Event<K>, watcher::Error>> {
        let event = match event {
            Ok(event) => event,
            Err(err) => return vec![Err(err)],
        };
        let listed = self.unlisted.is_empty();
        let known = self.known.entry(namespace.to_owned()).or_default();
        match event {
            watcher::Event::Init => {
                self.listing.insert(namespace.to_owned(), HashMap::new());
                Vec::new()
            }
            watcher::Event::InitApply(object) => {
                self.listing
                    .entry(namespace.to_owned())
                    .or_default()
                    .insert(object.name_any(), object);
                Vec::new()
            }
            watcher::Event::InitDone => {
                let now = self.listing.remove(namespace).unwrap_or_default();
                let before = std::mem::replace(known, now);
                if listed {
                    let known = &self.known[namespace];
                    let gone = before
                        .into_iter()
                        .filter(|(name, _)| !known.contains_key(name));
                    let mut changes: Vec<_> = gone
                        .map(|(_, object)| Ok(watcher::Event::Delete(object)))
                        .collect();
                    changes.extend(
                        known
                            .values()
                            .map(|object| Ok(watcher::Event::Apply(object.clone()))),
                    );
                    return changes;
                }
                self.unlisted.remove(namespace);
                if !self.unlisted.is_empty() {
                    return Vec::new();
                }
                let mut all = vec![Ok(watcher::Event::Init)];
                all.extend(self.known.values().flat_map(|objects| {
                    objects
                        .values()
                        .map(|object| Ok(watcher::Event::InitApply(object.clone())))
                }));
                all.push(Ok(watcher::Event::InitDone));
                all
            }
            watcher::Event::Apply(object) => {
                known.insert(object.name_any(), object.clone());
                match listed {
                    true => vec![Ok(watcher::Event::Apply(object))],
                    false => Vec::new(),
                }
            }
            watcher::Event::Delete(object) => {
                known.remove(&object.name_any());
                match listed {
                    true => vec![Ok(watcher::Event::Delete(object))],
                    false => Vec::new(),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::runtime::reflector;

    fn object(namespace: &str, name: &str) -> ConfigMap {
        let mut object = ConfigMap::default();
        object.metadata.namespace = Some(namespace.to_owned());
        object.metadata.name = Some(name.to_owned());
        object
    }

    /// Feeds `events` (namespace, event) through a merge into a reflector; the names it
    /// holds after each, as `namespace/name`, None before it is first ready.
    fn reflected(events: Vec<(&str, watcher::Event<ConfigMap>)>) -> Vec<Option<Vec<String>>> {
        let (store, mut writer) = reflector::store::<ConfigMap>();
        let mut merged = Merged::new(["a".to_owned(), "b".to_owned()].into_iter());
        let mut ready = false;
        events
            .into_iter()
            .map(|(namespace, event)| {
                for out in merged.take(namespace, Ok(event)) {
                    let out = out.unwrap();
                    ready |= matches!(out, watcher::Event::InitDone);
                    writer.apply_watcher_event(&out);
                }
                ready.then(|| {
                    let mut names: Vec<String> = store
                        .state()
                        .iter()
                        .map(|o| format!("{}/{}", o.namespace().unwrap(), o.name_any()))
                        .collect();
                    names.sort();
                    names
                })
            })
            .collect()
    }

    #[test]
    fn a_reflector_is_ready_once_every_namespace_has_listed_and_holds_them_all() {
        use watcher::Event::*;
        let after = reflected(vec![
            ("a", Init),
            ("a", InitApply(object("a", "x"))),
            ("a", InitDone),
            // Changes in a listed namespace while another still lists are kept, not lost.
            ("a", Apply(object("a", "y"))),
            ("b", Init),
            ("b", InitApply(object("b", "z"))),
            ("a", Delete(object("a", "x"))),
            ("b", InitDone),
        ]);
        assert!(after[..7].iter().all(Option::is_none), "{after:?}");
        assert_eq!(after[7], Some(vec!["a/y".to_owned(), "b/z".to_owned()]));
    }

    #[test]
    fn a_namespaces_relist_changes_only_its_own_objects() {
        use watcher::Event::*;
        let after = reflected(vec![
            ("a", Init),
            ("a", InitApply(object("a", "x"))),
            ("a", InitApply(object("a", "w"))),
            ("a", InitDone),
            ("b", Init),
            ("b", InitApply(object("b", "z"))),
            ("b", InitDone),
            // a's watch fell behind: while it lists again, the store keeps serving.
            ("a", Init),
            ("a", InitApply(object("a", "x"))),
            ("a", InitApply(object("a", "v"))),
            ("a", InitDone),
            ("b", Apply(object("b", "u"))),
        ]);
        let names = |n: &[&str]| Some(n.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(after[6], names(&["a/w", "a/x", "b/z"]));
        assert_eq!(after[9], names(&["a/w", "a/x", "b/z"]));
        assert_eq!(after[10], names(&["a/v", "a/x", "b/z"]));
        assert_eq!(after[11], names(&["a/v", "a/x", "b/u", "b/z"]));
    }

    #[test]
    fn a_scope_is_parsed_from_a_list_and_refuses_what_is_no_namespace() {
        assert_eq!(WatchScope::parse(""), Ok(WatchScope::Cluster));
        assert_eq!(WatchScope::parse(" , "), Ok(WatchScope::Cluster));
        let scope = WatchScope::parse("video, audio,video").unwrap();
        assert_eq!(
            scope,
            WatchScope::Namespaces(["audio".to_owned(), "video".to_owned()].into())
        );
        assert!(scope.covers("video") && !scope.covers("other"));
        assert_eq!(scope.describe(), "audio,video");
        let err = WatchScope::parse("video,Kube_System").unwrap_err();
        assert!(
            err.contains("\"Kube_System\" is not a namespace name"),
            "{err}"
        );
    }
}
