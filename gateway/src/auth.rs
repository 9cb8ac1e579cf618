//! Bearer tokens: which client is calling.

use std::path::Path;

use conveyor_core::config::Secret;
use serde::Deserialize;

/// The known clients and their tokens.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    clients: Vec<(String, Secret<String>)>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    clients: Vec<ClientEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClientEntry {
    name: String,
    token: String,
}

impl Tokens {
    /// `name=token` pairs separated by commas, as in `CONVEYOR_GATEWAY_TOKENS`.
    pub fn parse_pairs(pairs: &str) -> Result<Tokens, String> {
        let mut tokens = Tokens::default();
        for pair in pairs.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, token) = pair
                .split_once('=')
                .ok_or_else(|| "each token entry must be name=token".to_owned())?;
            tokens.add(name.trim(), token.trim())?;
        }
        Ok(tokens)
    }

    /// A YAML file: `clients: [{name: ..., token: ...}]`.
    pub fn load(path: &Path) -> Result<Tokens, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read tokens file {}: {e}", path.display()))?;
        let file: TokensFile = serde_yaml::from_str(&text)
            .map_err(|e| format!("tokens file {} is not valid: {e}", path.display()))?;
        let mut tokens = Tokens::default();
        for entry in file.clients {
            tokens.add(&entry.name, &entry.token)?;
        }
        Ok(tokens)
    }

    fn add(&mut self, name: &str, token: &str) -> Result<(), String> {
        if name.is_empty() || token.len() < 8 {
            return Err(format!(
                "client {name:?}: names must be non-empty and tokens at least 8 characters"
            ));
        }
        self.clients
            .push((name.to_owned(), Secret::new(token.to_owned())));
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
    pub fn client(&self, authorization: Option<&str>) -> Option<&str> {
        let presented = authorization?.strip_prefix("Bearer ")?.trim().as_bytes();
        // Compare against every token without stopping early, so timing says nothing.
        let mut found = None;
        for (name, token) in &self.clients {
            if constant_time_eq(token.expose().as_bytes(), presented) {
                found = Some(name.as_str());
            }
        }
        found
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_identify_clients() {
        let tokens = Tokens::parse_pairs("ci=secret-token-1, ops=secret-token-2").unwrap();
        assert_eq!(tokens.client(Some("Bearer secret-token-2")), Some("ops"));
        assert_eq!(tokens.client(Some("Bearer secret-token-3")), None);
        assert_eq!(tokens.client(Some("secret-token-1")), None);
        assert_eq!(tokens.client(None), None);
        assert!(Tokens::parse_pairs("short=abc").is_err());
        assert!(!format!("{tokens:?}").contains("secret-token"));
    }
}
