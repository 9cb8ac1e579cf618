//! Helpers for the state reconciles share: the process's locks and its watch caches.

use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use kube::runtime::reflector::Store;
use kube::Resource;

/// How long a reconcile waits for a watch cache to sync before it asks the API instead.
const CACHE_WAIT: Duration = Duration::from_secs(5);

/// The cache once its watch has synced (within [`CACHE_WAIT`]); `None` while it is not set
/// or its watch is restarting, and the caller asks the API.
pub async fn synced<K>(cache: &OnceLock<Store<K>>) -> Option<&Store<K>>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    let store = cache.get()?;
    let ready = tokio::time::timeout(CACHE_WAIT, store.wait_until_ready()).await;
    ready.is_ok_and(|r| r.is_ok()).then_some(store)
}

/// A poisoned lock still holds consistent maps here (each update is one insert or remove).
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// `every` plus `key`'s own share of half of it (FNV-1a of the key, the same in every
/// process): objects remembered together, at a start or a restart, come due spread out.
pub fn spread(key: &str, every: Duration) -> Duration {
    let half = (every.as_secs() / 2).max(1);
    every + Duration::from_secs(crate::build::fnv1a(key.bytes()) % half)
}

/// Who wrote which field is read for the pools' own objects only (`worker_pools/owned.rs`):
/// the kept TaskTypes, WorkerPools and pods drop it, more than half of each object.
pub fn without_managed_fields<K: kube::Resource>(object: &mut K) {
    object.meta_mut().managed_fields = None;
}
