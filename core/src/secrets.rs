//! Secrets the components make and compare: random ones, keyed digests, and a comparison
//! whose time says nothing about where two values differ.

use hmac::{Hmac, Mac};

/// 64 random hex digits (256 bits): passwords of roles and users, the operator's admin key.
pub fn random() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// HMAC-SHA256 of `parts` (fed one after another) under `key`, in hex.
pub fn keyed_hex(key: &[u8], parts: &[&[u8]]) -> String {
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(key).expect("HMAC takes any key length");
    for part in parts {
        mac.update(part);
    }
    mac.finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Whether `a` is `b`, in time that does not depend on where they differ.
pub fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
