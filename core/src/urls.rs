//! Query parameters of the services' URLs, where settings beyond the address live
//! (`sslmode`, `sslrootcert`, `cacertfile`, `heartbeat`).

/// The value of query parameter `key`, percent-decoded; `None` when it is absent (or the
/// URL does not parse, which its client reports itself).
pub fn query_param(url: &str, key: &str) -> Option<String> {
    reqwest::Url::parse(url)
        .ok()?
        .query_pairs()
        .find(|(k, _)| k == key)
        .map(|(_, value)| value.into_owned())
}

/// `url` with `params` set: replaced where present, added where not, the rest kept.
pub fn with_params(url: &str, params: &[(&str, &str)]) -> Result<String, url::ParseError> {
    let mut url = reqwest::Url::parse(url)?;
    let kept: Vec<(String, String)> = url
        .query_pairs()
        .filter(|(key, _)| params.iter().all(|(k, _)| k != key))
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    url.query_pairs_mut()
        .clear()
        .extend_pairs(kept)
        .extend_pairs(params.iter().copied());
    Ok(url.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_percent_decoded() {
        let url = "amqps://h/%2f?heartbeat=5&cacertfile=%2Fetc%2Fca.crt&odd=/a%zz";
        assert_eq!(
            query_param(url, "cacertfile").as_deref(),
            Some("/etc/ca.crt")
        );
        assert_eq!(query_param(url, "odd").as_deref(), Some("/a%zz"));
        assert_eq!(query_param(url, "missing"), None);
        assert_eq!(
            with_params("postgres://h/db", &[("a", "1")]).unwrap(),
            "postgres://h/db?a=1"
        );
        assert_eq!(
            with_params("postgres://h/db?a=1&b=2", &[("a", "3"), ("c", "/x")]).unwrap(),
            "postgres://h/db?b=2&a=3&c=%2Fx"
        );
    }
}
