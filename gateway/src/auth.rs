//! Bearer tokens: which client is calling, and which tenants (namespaces) it may use.
//!
//! Tokens are kept only as SHA-256 digests: a tokens file may hold the digest alone
//! (`tokenSha256`), and a plain `token` is hashed as it is read.

use std::path::Path;
use std::sync::{Arc, RwLock};

use conveyor_core::task_type::DEFAULT_TENANT;
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Stands for every namespace in a client's list: an administrator's token.
pub const ALL_TENANTS: &str = "*";

/// A client: its name and the tenants its token belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Client {
    pub name: String,
    tenants: Vec<String>,
    /// Made by a namespace's own ClientToken resource, whose token nobody but its team saw:
    /// held to [`strong_enough`] when it is presented.
    self_service: bool,
}

impl Client {
    pub fn new(name: &str, tenants: &[&str]) -> Client {
        Client {
            name: name.to_owned(),
            tenants: tenants.iter().map(|t| (*t).to_owned()).collect(),
            self_service: false,
        }
    }

    /// Whether a ClientToken resource made this client (see [`strong_enough`]).
    pub fn self_service(&self) -> bool {
        self.self_service
    }

    /// The one namespace this client works in, whose clients share that namespace's limits
    /// (`crate::limits::NamespaceLimits`); `None` for a client of several namespaces or
    /// of all (an administrator's), held to its own limits alone.
    pub fn namespace(&self) -> Option<&str> {
        match self.tenants.as_slice() {
            [one] if one != ALL_TENANTS => Some(one),
            _ => None,
        }
    }

    /// Whether this client may submit to and read the tasks of `tenant`.
    pub fn may_use(&self, tenant: &str) -> bool {
        self.tenants.iter().any(|t| t == tenant || t == ALL_TENANTS)
    }

    /// The tenants this client may see, or `None` for an administrator's token (every one).
    pub fn tenants(&self) -> Option<&[String]> {
        (!self.tenants.iter().any(|t| t == ALL_TENANTS)).then_some(self.tenants.as_slice())
    }

    /// The tenant a request means when it names none: the client's only one, or else
    /// `default` if the client may use it.
    pub fn implied_tenant(&self) -> Option<&str> {
        match self.tenants.as_slice() {
            [one] if one != ALL_TENANTS => Some(one),
            _ if self.may_use(DEFAULT_TENANT) => Some(DEFAULT_TENANT),
            _ => None,
        }
    }
}

/// The known clients, each with the digest of its token.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    clients: Vec<(Client, [u8; 32])>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    clients: Vec<ClientEntry>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ClientEntry {
    name: String,
    #[serde(default)]
    token: Option<String>,
    #[serde(default)]
    token_sha256: Option<String>,
    #[serde(default)]
    namespaces: Option<Vec<String>>,
}

impl Tokens {
    /// Entries separated by commas, as in `CONVEYOR_GATEWAY_TOKENS`: `name=token` (tenant
    /// `default`) or `name@ns1+ns2=token` (those namespaces; `@*` for all of them). The
    /// token may be given as its digest, `sha256:<64 hex digits>`, so that the Secret the
    /// variable comes from holds no usable token.
    pub fn parse_pairs(pairs: &str) -> Result<Tokens, String> {
        let mut tokens = Tokens::default();
        for pair in pairs.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (who, token) = pair
                .split_once('=')
                .ok_or_else(|| "each token entry must be name=token or name@ns=token".to_owned())?;
            let (name, tenants) = match who.split_once('@') {
                Some((name, list)) => (name, list.split('+').map(str::trim).collect()),
                None => (who, vec![DEFAULT_TENANT]),
            };
            let token = token.trim();
            let credential = match token.strip_prefix("sha256:") {
                Some(digest) => Credential::Digest(digest),
                None => Credential::Plain(token),
            };
            tokens.add(name.trim(), credential, &tenants)?;
        }
        Ok(tokens)
    }

    /// A YAML file: `clients: [{name, token | tokenSha256, namespaces: [...]}]`; without
    /// `namespaces` a client belongs to tenant `default`.
    pub fn load(path: &Path) -> Result<Tokens, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read tokens file {}: {e}", path.display()))?;
        let file: TokensFile = serde_yaml::from_str(&text)
            .map_err(|e| format!("tokens file {} is not valid: {e}", path.display()))?;
        let mut tokens = Tokens::default();
        for entry in file.clients {
            let secret = match (&entry.token, &entry.token_sha256) {
                (Some(token), None) => Credential::Plain(token),
                (None, Some(digest)) => Credential::Digest(digest),
                _ => {
                    return Err(format!(
                        "client {:?}: give exactly one of token and tokenSha256",
                        entry.name
                    ))
                }
            };
            let tenants: Vec<&str> = match &entry.namespaces {
                Some(list) => list.iter().map(String::as_str).collect(),
                None => vec![DEFAULT_TENANT],
            };
            tokens.add(&entry.name, secret, &tenants)?;
        }
        Ok(tokens)
    }

    fn add(&mut self, name: &str, secret: Credential<'_>, tenants: &[&str]) -> Result<(), String> {
        if name.is_empty() {
            return Err("client names must be non-empty".to_owned());
        }
        let digest = match secret {
            Credential::Plain(token) if token.len() < 8 => {
                return Err(format!(
                    "client {name:?}: tokens must be at least 8 characters"
                ))
            }
            Credential::Plain(token) => sha256(token.as_bytes()),
            Credential::Digest(hex) => parse_digest(hex)
                .ok_or_else(|| format!("client {name:?}: tokenSha256 must be 64 hex digits"))?,
        };
        self.push(name, digest, tenants)
    }

    /// Adds a client by its token's digest, once its tenants are known to be valid.
    fn push(&mut self, name: &str, digest: [u8; 32], tenants: &[&str]) -> Result<(), String> {
        let valid_tenant = |t: &&str| {
            *t == ALL_TENANTS
                || (!t.is_empty()
                    && t.len() <= 63
                    && t.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))
        };
        if tenants.is_empty() || !tenants.iter().all(valid_tenant) {
            return Err(format!(
                "client {name:?}: namespaces must be a non-empty list of namespace names (or \"*\")"
            ));
        }
        self.clients.push((Client::new(name, tenants), digest));
        Ok(())
    }

    /// A token known by its digest (hex), for the namespaces it is listed in: the
    /// ClientToken resources, where one digest in several namespaces is one client.
    pub fn add_listed(&mut self, name: &str, digest: &str, tenant: &str) -> Result<(), String> {
        let digest = parse_digest(digest)
            .ok_or_else(|| format!("client {name:?}: tokenSha256 must be 64 hex digits"))?;
        if let Some((client, _)) = self.clients.iter_mut().find(|(_, d)| *d == digest) {
            if !client.may_use(tenant) {
                client.tenants.push(tenant.to_owned());
            }
            return Ok(());
        }
        self.push(name, digest, &[tenant])?;
        if let Some((client, _)) = self.clients.last_mut() {
            client.self_service = true;
        }
        Ok(())
    }

    pub fn merge(mut self, other: Tokens) -> Tokens {
        self.clients.extend(other.clients);
        self
    }

    pub fn is_empty(&self) -> bool {
        self.clients.is_empty()
    }

    /// The client an `Authorization` header value belongs to.
    pub fn client(&self, authorization: Option<&str>) -> Option<&Client> {
        let presented = authorization?.strip_prefix("Bearer ")?.trim();
        let digest = sha256(presented.as_bytes());
        // Compare against every digest without stopping early, so timing says nothing.
        let mut found = None;
        for (client, known) in &self.clients {
            if conveyor_core::secrets::same(known, &digest) && found.is_none() {
                found = Some(client);
            }
        }
        found
    }
}

/// The fewest bits a ClientToken's token must show ([`strong_enough`]): a resource holds
/// only a digest, so its token is judged when presented. A guessable token would let anyone
/// in the cluster act as that namespace (issue 33, item 7).
pub const MIN_TOKEN_BITS: f64 = 128.0;

/// Whether `token` looks drawn from a random source: at least 20 characters; at least
/// [`MIN_TOKEN_BITS`] counted as the characters a guesser does not get for free
/// ([`predictable`]) times the bits of the character classes it uses (lower case 26, upper
/// case 26, digits 10, others 33); and no character class of repetition (its characters'
/// own entropy at least 2.5 bits each: 32 random hex digits fall under 3 one time in eight
/// thousand, never under 2.5 in 200,000 draws). `openssl rand -hex 32`,
/// `secrets.token_urlsafe(32)` and a UUID pass; `password123`, the alphabet, a run of one
/// letter and a phrase said twice do not. A judgement of form, not proof: a long phrase of
/// words passes.
pub fn strong_enough(token: &str) -> bool {
    let chars: Vec<char> = token.chars().collect();
    let n = chars.len();
    if n < 20 {
        return false;
    }
    let counted = n - predictable(&chars[..n.min(256)]);
    type Class = (fn(char) -> bool, f64);
    let classes: [Class; 4] = [
        (|c| c.is_ascii_lowercase(), 26.0),
        (|c| c.is_ascii_uppercase(), 26.0),
        (|c| c.is_ascii_digit(), 10.0),
        (|c| !c.is_ascii_alphanumeric(), 33.0),
    ];
    let alphabet: f64 = classes
        .iter()
        .filter(|(is, _)| token.chars().any(is))
        .map(|(_, size)| size)
        .sum();
    let mut counts = std::collections::HashMap::new();
    for c in token.chars() {
        *counts.entry(c).or_insert(0usize) += 1;
    }
    let per_char: f64 = counts
        .values()
        .map(|&k| {
            let p = k as f64 / n as f64;
            -p * p.log2()
        })
        .sum();
    counted as f64 * alphabet.log2() >= MIN_TOKEN_BITS && per_char >= 2.5
}

/// The characters of `chars` a guesser gets for free: each one that continues a run of
/// three or more with the same step of -1, 0 or +1 (`aaa`, `abc`, `321`), and each one of a
/// stretch of four or more that repeats an earlier one (`Password123!Password123!`). Random
/// tokens have few: a run by chance is one in a few hundred characters.
fn predictable(chars: &[char]) -> usize {
    let mut free = 0;
    let mut i = 0;
    while i < chars.len() {
        let repeated = (0..i)
            .map(|start| {
                let earlier = chars[start..].iter().zip(&chars[i..]);
                earlier.take_while(|(a, b)| a == b).count()
            })
            .max()
            .unwrap_or(0);
        if repeated >= 4 {
            free += repeated;
            i += repeated;
            continue;
        }
        if i >= 2 {
            let step = |a: char, b: char| i64::from(u32::from(b)) - i64::from(u32::from(a));
            let (before, now) = (
                step(chars[i - 2], chars[i - 1]),
                step(chars[i - 1], chars[i]),
            );
            if before == now && now.abs() <= 1 {
                free += 1;
            }
        }
        i += 1;
    }
    free
}

/// The tokens in force: those of the file and environment, and (in a cluster) those of the
/// ClientToken resources, replaced as they are listed again.
#[derive(Default)]
pub struct TokenSet {
    current: RwLock<Arc<Tokens>>,
}

impl TokenSet {
    pub fn new(tokens: Tokens) -> TokenSet {
        TokenSet {
            current: RwLock::new(Arc::new(tokens)),
        }
    }

    pub fn current(&self) -> Arc<Tokens> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn replace(&self, tokens: Tokens) {
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(tokens);
    }
}

enum Credential<'a> {
    Plain(&'a str),
    Digest(&'a str),
}

/// SHA-256 of a token, as `tokenSha256` holds it (hex: `printf %s TOKEN | sha256sum`).
pub fn sha256(token: &[u8]) -> [u8; 32] {
    Sha256::digest(token).into()
}

fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim();
    if hex.len() != 64 || !hex.is_ascii() {
        return None;
    }
    let mut digest = [0u8; 32];
    for (i, byte) in digest.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(digest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(digest: &[u8; 32]) -> String {
        digest.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn tokens_identify_clients_and_their_tenants() {
        let tokens =
            Tokens::parse_pairs("ci=secret-token-1, ops@video+audio=secret-token-2").unwrap();
        let ops = tokens.client(Some("Bearer secret-token-2")).unwrap();
        assert_eq!(ops.name, "ops");
        assert!(ops.may_use("video") && ops.may_use("audio") && !ops.may_use("default"));
        assert_eq!(ops.implied_tenant(), None);
        let ci = tokens.client(Some("Bearer secret-token-1")).unwrap();
        assert_eq!(ci.implied_tenant(), Some("default"));
        assert_eq!(tokens.client(Some("Bearer secret-token-3")), None);
        assert_eq!(tokens.client(Some("secret-token-1")), None);
        assert_eq!(tokens.client(None), None);
        assert!(Tokens::parse_pairs("short=abc").is_err());
        assert!(Tokens::parse_pairs("x@Bad_NS=secret-token-1").is_err());
        assert!(!format!("{tokens:?}").contains("secret-token"));
    }

    #[test]
    fn an_entry_may_hold_only_the_digest() {
        let digest = hex(&sha256(b"secret-token-4"));
        let tokens = Tokens::parse_pairs(&format!("ci@video=sha256:{digest}")).unwrap();
        let ci = tokens.client(Some("Bearer secret-token-4")).unwrap();
        assert!(ci.may_use("video"));
        assert_eq!(
            tokens.client(Some(&format!("Bearer sha256:{digest}"))),
            None
        );
        assert!(Tokens::parse_pairs("ci=sha256:abc").is_err());
    }

    #[test]
    fn one_digest_listed_in_two_namespaces_is_one_client_of_both() {
        let digest = hex(&sha256(b"shared-secret-1"));
        let mut tokens = Tokens::default();
        tokens.add_listed("video/ci", &digest, "video").unwrap();
        tokens.add_listed("audio/ci", &digest, "audio").unwrap();
        let client = tokens.client(Some("Bearer shared-secret-1")).unwrap();
        assert!(client.may_use("video") && client.may_use("audio") && !client.may_use("default"));
        assert!(tokens.add_listed("x", "not-hex", "video").is_err());
    }

    #[test]
    fn a_file_may_hold_only_the_digest() {
        let dir = std::env::temp_dir().join(format!("conveyor-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("tokens.yaml");
        let digest: String = sha256(b"video-secret-1")
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        std::fs::write(
            &file,
            format!("clients:\n  - name: video\n    tokenSha256: {digest}\n    namespaces: [video]\n  - name: admin\n    token: admin-secret-1\n    namespaces: ['*']\n"),
        )
        .unwrap();
        let tokens = Tokens::load(&file).unwrap();
        let video = tokens.client(Some("Bearer video-secret-1")).unwrap();
        assert_eq!(video.implied_tenant(), Some("video"));
        let admin = tokens.client(Some("Bearer admin-secret-1")).unwrap();
        assert!(admin.may_use("anything"));
        assert_eq!(admin.implied_tenant(), Some("default"));
        std::fs::write(
            &file,
            "clients:\n  - name: x\n    token: secret-token-1\n    tokenSha256: ab\n",
        )
        .unwrap();
        assert!(Tokens::load(&file).unwrap_err().contains("exactly one"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_clienttokens_token_must_look_random() {
        assert!(
            strong_enough("3f9c1e0a7b2d4c6e8f1a3b5c7d9e0f21"),
            "32 random hex digits"
        );
        assert!(strong_enough(&format!(
            "team-token-{}",
            uuid::Uuid::new_v4()
        )));
        assert!(!strong_enough("password123"), "short");
        assert!(!strong_enough(&"a".repeat(64)), "one letter");
        assert!(
            !strong_enough("abababababababababababababababab"),
            "two letters"
        );
        // Long enough by their classes, and guessed by anyone who tries the obvious.
        for weak in [
            "Password123!Password123!",
            "abcdefghijklmnopqrstuvwxyz0123",
            "zyxwvutsrqponmlkjihgfedcba9876",
            "Conveyor-2026-Conveyor-2026-Conveyor",
        ] {
            assert!(!strong_enough(weak), "{weak}");
        }
        // What the README and the refusal tell users to make passes, every time.
        for _ in 0..2000 {
            let hex = format!(
                "{}{}",
                uuid::Uuid::new_v4().simple(),
                uuid::Uuid::new_v4().simple()
            );
            assert!(strong_enough(&hex), "openssl rand -hex 32: {hex}");
        }
        assert!(
            strong_enough("correct horse battery staple canoe"),
            "a phrase of words"
        );
        let mut tokens = Tokens::default();
        let digest = "ab".repeat(32);
        tokens.add_listed("team", &digest, "video").unwrap();
        assert!(tokens.clients[0].0.self_service());
        let fixed = Tokens::parse_pairs("ci@video=a-fixed-token").unwrap();
        assert!(!fixed.clients[0].0.self_service());
    }
}
