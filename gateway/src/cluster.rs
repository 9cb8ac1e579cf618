//! The gateway in a cluster: the TaskType and ClientToken resources of every namespace
//! (ClientTokens hold digests only, so the gateway needs no access to Secrets), listed at
//! start, then followed by a watch of each. At rest the gateway asks the apiserver nothing;
//! a list of everything every refresh cost a request and a copy of every object each time,
//! however few of them had changed.

use std::sync::Arc;
use std::time::Duration;

use conveyor_core::crd::{ClientToken, TaskType};
use conveyor_core::task_type::NamedTaskType;
use conveyor_core::watch_scope::{WatchScope, Watched};
use futures_util::StreamExt as _;
use kube::api::ListParams;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt as _};
use kube::{Resource, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::auth::{TokenSet, Tokens};
use crate::registry::Registry;

/// Every TaskType in `scope`, as the data path sees it.
pub async fn list_types(
    client: &kube::Client,
    scope: &WatchScope,
) -> Result<Vec<NamedTaskType>, kube::Error> {
    let listed = scope
        .list::<TaskType>(client, &ListParams::default())
        .await?;
    Ok(listed.iter().map(NamedTaskType::from).collect())
}

/// `fixed` (file and environment) and every ClientToken in `scope`, each for its namespace.
pub async fn list_tokens(
    client: &kube::Client,
    scope: &WatchScope,
    fixed: &Tokens,
) -> Result<Tokens, kube::Error> {
    let listed = scope
        .list::<ClientToken>(client, &ListParams::default())
        .await?;
    Ok(with_client_tokens(fixed, listed.iter()))
}

/// `fixed` and `resources`; a malformed one is left out and logged, the rest serve.
fn with_client_tokens<'a>(
    fixed: &Tokens,
    resources: impl Iterator<Item = &'a ClientToken>,
) -> Tokens {
    let mut tokens = fixed.clone();
    for resource in resources {
        let namespace = resource.namespace().unwrap_or_default();
        let name = format!("{namespace}/{}", resource.name_any());
        if let Err(err) = tokens.add_listed(&name, &resource.spec.token_sha256, &namespace) {
            tracing::warn!(client = name, error = err, "ClientToken refused");
        }
    }
    tokens
}

/// Which watch an event came from.
#[derive(Clone, Copy)]
enum Kind {
    TaskTypes,
    ClientTokens,
}

/// One watch's state: what it holds, whether its first list is in (an empty store before
/// that is not an empty cluster), and whether it changed since it was last taken in.
struct Followed<K: Resource + Clone + 'static>
where
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    store: Store<K>,
    listed: bool,
    changed: bool,
}

impl<K: Resource + Clone + 'static> Followed<K>
where
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    fn new(store: Store<K>) -> Self {
        Followed {
            store,
            listed: false,
            changed: false,
        }
    }

    fn saw(&mut self, first_list_done: bool) {
        self.listed |= first_list_done;
        self.changed = true;
    }

    /// The objects, once, if they changed since the last call and the first list is in.
    fn take(&mut self) -> Option<Vec<Arc<K>>> {
        if !(self.listed && self.changed) {
            return None;
        }
        self.changed = false;
        Some(self.store.state())
    }
}

/// Watches the TaskTypes and ClientTokens until `shutdown`, and takes in what changed at
/// most every `interval` (a burst of edits makes one rebuild). A failed watch keeps the
/// last set of its kind and tries again with a backoff. `fixed` are the tokens of the
/// file and environment.
pub async fn follow(
    registry: Arc<Registry>,
    tokens: Arc<TokenSet>,
    fixed: Tokens,
    client: kube::Client,
    scope: WatchScope,
    interval: Duration,
    shutdown: CancellationToken,
) {
    let (mut types, type_events) = watch::<TaskType>(&client, &scope, Kind::TaskTypes);
    let (mut clients, token_events) = watch::<ClientToken>(&client, &scope, Kind::ClientTokens);
    let mut events = std::pin::pin!(futures_util::stream::select(type_events, token_events));
    let mut take_in = tokio::time::interval(interval);
    take_in.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            event = events.next() => match event {
                Some((Kind::TaskTypes, Ok(done))) => types.saw(done),
                Some((Kind::ClientTokens, Ok(done))) => clients.saw(done),
                Some((Kind::TaskTypes, Err(err))) => {
                    tracing::warn!(error = %err, "watch of TaskTypes failed; keeping the last set")
                }
                Some((Kind::ClientTokens, Err(err))) => {
                    tracing::warn!(error = %err, "watch of ClientTokens failed; keeping the last set")
                }
                // A watcher's stream does not end; were it to, the last sets keep serving.
                None => return,
            },
            _ = take_in.tick() => {
                if let Some(listed) = types.take() {
                    registry.replace(listed.iter().map(|t| NamedTaskType::from(t.as_ref())).collect());
                }
                if let Some(listed) = clients.take() {
                    tokens.replace(with_client_tokens(&fixed, listed.iter().map(|t| t.as_ref())));
                }
            }
        }
    }
}

/// A watch of every `K` in `scope` (managed fields dropped) into a store, and its events: for each,
/// `kind`, and whether it ended a (re)list.
fn watch<K: Watched>(
    client: &kube::Client,
    scope: &WatchScope,
    kind: Kind,
) -> (
    Followed<K>,
    impl futures_util::Stream<Item = (Kind, Result<bool, watcher::Error>)>,
) {
    let (store, writer) = reflector::store::<K>();
    let events = scope
        .watch::<K>(client, watcher::Config::default(), |object: &mut K| {
            object.managed_fields_mut().clear()
        })
        .reflect(writer)
        .map(move |event| (kind, event.map(|e| matches!(e, watcher::Event::InitDone))));
    (Followed::new(store), events)
}
