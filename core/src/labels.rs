//! Task labels and label selectors, in Kubernetes' syntax so that platform teams write
//! them the way they already do (`kubectl get pods -l 'tier in (gold),!canary'`).
//!
//! Labels are a small string map given at submission and never changed afterwards; a
//! selector is parsed here into [`Requirement`]s, which `crate::db` turns into SQL.

use std::collections::BTreeMap;
use std::fmt;

/// The labels of one task.
pub type Labels = BTreeMap<String, String>;

/// Most labels one task may carry: enough to name a pipeline, an asset and a customer, and
/// few enough that a row stays small.
pub const MAX_LABELS: usize = 16;
/// Longest label name (after its optional prefix) and value, as in Kubernetes.
pub const MAX_NAME: usize = 63;
/// Longest label prefix (a DNS subdomain).
pub const MAX_PREFIX: usize = 253;
/// Most requirements one selector may hold.
pub const MAX_REQUIREMENTS: usize = 16;

/// Why labels or a selector were refused; the message names the offending part.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LabelError(pub String);

fn refuse<T>(message: impl Into<String>) -> Result<T, LabelError> {
    Err(LabelError(message.into()))
}

/// `[A-Za-z0-9]` at both ends, `[-_.A-Za-z0-9]` between, at most [`MAX_NAME`] long.
fn is_name(s: &str) -> bool {
    let ends = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    s.len() <= MAX_NAME
        && ends(s.chars().next())
        && ends(s.chars().last())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// A DNS subdomain: lower-case labels of `[a-z0-9-]` joined by dots.
fn is_prefix(s: &str) -> bool {
    s.len() <= MAX_PREFIX
        && s.split('.').all(|part| {
            !part.is_empty()
                && part.len() <= 63
                && !part.starts_with('-')
                && !part.ends_with('-')
                && part
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        })
}

/// Checks a label key: `name` or `prefix/name`.
pub fn check_key(key: &str) -> Result<(), LabelError> {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if prefix.is_some_and(|p| !is_prefix(p)) {
        return refuse(format!(
            "label key {key:?}: its prefix must be a DNS subdomain (lower-case letters, digits, \
             '-' and '.', at most {MAX_PREFIX} characters)"
        ));
    }
    if !is_name(name) {
        return refuse(format!(
            "label key {key:?}: a name is 1 to {MAX_NAME} letters, digits, '-', '_' or '.', \
             starting and ending with a letter or digit"
        ));
    }
    Ok(())
}

/// Checks a label value: empty, or a name.
pub fn check_value(key: &str, value: &str) -> Result<(), LabelError> {
    if value.is_empty() || is_name(value) {
        Ok(())
    } else {
        refuse(format!(
            "label {key:?}: a value is empty or up to {MAX_NAME} letters, digits, '-', '_' or \
             '.', starting and ending with a letter or digit (got {value:?})"
        ))
    }
}

/// Checks a task's labels before anything is recorded.
pub fn check(labels: &Labels) -> Result<(), LabelError> {
    if labels.len() > MAX_LABELS {
        return refuse(format!(
            "a task carries at most {MAX_LABELS} labels, not {}",
            labels.len()
        ));
    }
    for (key, value) in labels {
        check_key(key)?;
        check_value(key, value)?;
    }
    Ok(())
}

/// One term of a selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requirement {
    /// `key` or `key=value` style: the label is present (with one of `values`, if any).
    In { key: String, values: Vec<String> },
    /// `!key`, `key!=value`, `key notin (...)`: the label is absent or has none of `values`
    /// (absent altogether when `values` is empty).
    NotIn { key: String, values: Vec<String> },
}

/// A parsed label selector: every requirement must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector(pub Vec<Requirement>);

impl Selector {
    /// Parses `a=b,c!=d,e in (x,y),f notin (z),g,!h`. Empty text selects everything.
    pub fn parse(text: &str) -> Result<Selector, LabelError> {
        let mut requirements = Vec::new();
        for term in split_terms(text)? {
            requirements.push(parse_term(term)?);
        }
        if requirements.len() > MAX_REQUIREMENTS {
            return refuse(format!(
                "a selector holds at most {MAX_REQUIREMENTS} requirements"
            ));
        }
        Ok(Selector(requirements))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `labels` satisfy every requirement (the same rule the SQL applies).
    pub fn matches(&self, labels: &Labels) -> bool {
        self.0.iter().all(|requirement| match requirement {
            Requirement::In { key, values } => labels
                .get(key)
                .is_some_and(|v| values.is_empty() || values.contains(v)),
            Requirement::NotIn { key, values } => match labels.get(key) {
                None => true,
                Some(v) => !values.is_empty() && !values.contains(v),
            },
        })
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let terms: Vec<String> = self
            .0
            .iter()
            .map(|r| match r {
                Requirement::In { key, values } if values.is_empty() => key.clone(),
                Requirement::In { key, values } => format!("{key} in ({})", values.join(",")),
                Requirement::NotIn { key, values } if values.is_empty() => format!("!{key}"),
                Requirement::NotIn { key, values } => {
                    format!("{key} notin ({})", values.join(","))
                }
            })
            .collect();
        f.write_str(&terms.join(","))
    }
}

/// Splits at the commas that are outside parentheses.
fn split_terms(text: &str) -> Result<Vec<&str>, LabelError> {
    let mut terms = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' if depth == 0 => return refuse(format!("selector {text:?}: unmatched ')'")),
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return refuse(format!("selector {text:?}: unmatched '('"));
    }
    terms.push(&text[start..]);
    let terms: Vec<&str> = terms.into_iter().map(str::trim).collect();
    if terms == [""] {
        return Ok(Vec::new());
    }
    if let Some(empty) = terms.iter().position(|t| t.is_empty()) {
        return refuse(format!(
            "selector {text:?}: requirement {} is empty",
            empty + 1
        ));
    }
    Ok(terms)
}

fn parse_term(term: &str) -> Result<Requirement, LabelError> {
    let key_of = |key: &str| -> Result<String, LabelError> {
        let key = key.trim();
        check_key(key)?;
        Ok(key.to_owned())
    };
    let value_of = |key: &str, value: &str| -> Result<String, LabelError> {
        let value = value.trim();
        check_value(key, value)?;
        Ok(value.to_owned())
    };
    if let Some(key) = term.strip_prefix('!') {
        let key = key_of(key)?;
        return Ok(Requirement::NotIn {
            key,
            values: Vec::new(),
        });
    }
    if let Some((key, value)) = term.split_once("!=") {
        let key = key_of(key)?;
        let value = value_of(&key, value)?;
        return Ok(Requirement::NotIn {
            key,
            values: vec![value],
        });
    }
    if let Some((key, value)) = term.split_once('=') {
        let key = key_of(key)?;
        let value = value_of(&key, value.strip_prefix('=').unwrap_or(value))?;
        return Ok(Requirement::In {
            key,
            values: vec![value],
        });
    }
    if let Some(open) = term.find('(') {
        let head = term[..open].trim_end();
        let Some(list) = term[open + 1..].strip_suffix(')') else {
            return refuse(format!("selector term {term:?}: a set ends with ')'"));
        };
        let (key, negated) = if let Some(key) = head.strip_suffix(" notin") {
            (key, true)
        } else if let Some(key) = head.strip_suffix(" in") {
            (key, false)
        } else {
            return refuse(format!(
                "selector term {term:?}: a set follows `in` or `notin`"
            ));
        };
        let key = key_of(key)?;
        if list.trim().is_empty() {
            return refuse(format!(
                "selector term {term:?}: a set holds 1 to {MAX_LABELS} values"
            ));
        }
        let values = list
            .split(',')
            .map(|v| value_of(&key, v))
            .collect::<Result<Vec<_>, _>>()?;
        if values.is_empty() || values.len() > MAX_LABELS {
            return refuse(format!(
                "selector term {term:?}: a set holds 1 to {MAX_LABELS} values"
            ));
        }
        return Ok(if negated {
            Requirement::NotIn { key, values }
        } else {
            Requirement::In { key, values }
        });
    }
    Ok(Requirement::In {
        key: key_of(term)?,
        values: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn valid_labels_pass_and_bad_ones_say_why() {
        let good = labels(&[
            ("pipeline", "vod-ingest"),
            ("example.com/asset", "A_12.mp4"),
            ("empty", ""),
        ]);
        assert_eq!(check(&good), Ok(()));
        for (key, value) in [
            ("", "x"),
            ("-lead", "x"),
            ("Upper.Case/name", "x"),
            ("a/b/c", "x"),
            ("spaced key", "x"),
            ("ok", "trailing-"),
            ("ok", "no spaces"),
        ] {
            let err = check(&labels(&[(key, value)])).unwrap_err();
            assert!(err.0.contains(&format!("{key:?}")), "{err}");
        }
        let long = "x".repeat(MAX_NAME + 1);
        assert!(check(&labels(&[("ok", long.as_str())])).is_err());
        assert!(check(&labels(&[(long.as_str(), "ok")])).is_err());
        let many: Labels = (0..=MAX_LABELS)
            .map(|i| (format!("k{i}"), "v".to_owned()))
            .collect();
        assert!(check(&many).unwrap_err().0.contains("at most"));
    }

    #[test]
    fn selectors_parse_every_kubernetes_form() {
        let selector =
            Selector::parse(" a=b , c==d,e!=f, g in (x, y),h notin (z),i,!j ").expect("parses");
        let s = |v: &[&str]| v.iter().map(|v| (*v).to_owned()).collect::<Vec<_>>();
        use Requirement::*;
        assert_eq!(
            selector.0,
            vec![
                In {
                    key: "a".into(),
                    values: s(&["b"])
                },
                In {
                    key: "c".into(),
                    values: s(&["d"])
                },
                NotIn {
                    key: "e".into(),
                    values: s(&["f"])
                },
                In {
                    key: "g".into(),
                    values: s(&["x", "y"])
                },
                NotIn {
                    key: "h".into(),
                    values: s(&["z"])
                },
                In {
                    key: "i".into(),
                    values: vec![]
                },
                NotIn {
                    key: "j".into(),
                    values: vec![]
                },
            ]
        );
        assert_eq!(
            selector.to_string(),
            "a in (b),c in (d),e notin (f),g in (x,y),h notin (z),i,!j"
        );
        assert!(Selector::parse("").expect("empty").is_empty());
    }

    #[test]
    fn malformed_selectors_are_refused() {
        for bad in [
            "a=b,,c",
            "a in (x",
            "a in x)",
            "a between (x)",
            "a in ()",
            "=b",
            "a=b c",
            "!",
        ] {
            assert!(Selector::parse(bad).is_err(), "{bad:?} parsed");
        }
        let many = (0..=MAX_REQUIREMENTS)
            .map(|i| format!("k{i}"))
            .collect::<Vec<_>>()
            .join(",");
        assert!(Selector::parse(&many).is_err());
    }

    #[test]
    fn matching_follows_kubernetes() {
        let l = labels(&[("tier", "gold"), ("canary", "")]);
        let yes = |s: &str| Selector::parse(s).unwrap().matches(&l);
        assert!(yes("tier=gold"));
        assert!(yes("tier in (gold,silver)"));
        assert!(yes("tier,canary"));
        assert!(yes("region!=eu") && yes("!region") && yes("region notin (eu)"));
        assert!(!yes("tier!=gold") && !yes("!canary") && !yes("tier notin (gold)"));
        assert!(!yes("region") && !yes("region=eu"));
    }
}
