//! JSON as PostgreSQL's `jsonb` takes and prints it: what it refuses that JSON allows, and
//! how long its text is. Input is checked with these at the edge, so that one refused value
//! never reaches a statement that other tenants' rows share (issue 33, item 4).

use serde_json::Value;

/// The JSON pointer of the first string or key holding `\u0000`, which `jsonb` refuses
/// ("unsupported Unicode escape sequence"); `None` when there is none.
pub fn nul_at(value: &Value) -> Option<String> {
    fn escape(token: &str) -> String {
        token.replace('~', "~0").replace('/', "~1")
    }
    match value {
        Value::String(s) if s.contains('\0') => Some(String::new()),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, item)| nul_at(item).map(|rest| format!("/{i}{rest}"))),
        Value::Object(fields) => fields.iter().find_map(|(key, item)| {
            if key.contains('\0') {
                Some(format!("/{}", escape(key)))
            } else {
                nul_at(item).map(|rest| format!("/{}{rest}", escape(key)))
            }
        }),
        _ => None,
    }
}

/// The bytes of `value::jsonb::text`: `jsonb` prints a space after each `:` and `,`, and a
/// number in plain notation, never with an exponent (`1e300` is 301 digits).
pub fn text_len(value: &Value) -> usize {
    match value {
        Value::Null | Value::Bool(_) | Value::String(_) => value.to_string().len(),
        Value::Number(n) => plain_len(&n.to_string()),
        Value::Array(items) => {
            2 + items.iter().map(text_len).sum::<usize>() + 2 * items.len().saturating_sub(1)
        }
        Value::Object(fields) => {
            2 + fields
                .iter()
                .map(|(k, v)| Value::String(k.clone()).to_string().len() + 2 + text_len(v))
                .sum::<usize>()
                + 2 * fields.len().saturating_sub(1)
        }
    }
}

/// The length of a JSON number written without an exponent.
fn plain_len(number: &str) -> usize {
    let (sign, unsigned) = match number.strip_prefix('-') {
        Some(rest) => (1, rest),
        None => (0, number),
    };
    let Some((mantissa, exponent)) = unsigned.split_once(['e', 'E']) else {
        return number.len();
    };
    let exponent: i64 = exponent.parse().unwrap_or(0);
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = format!("{whole}{fraction}");
    let digits = digits.trim_start_matches('0');
    // Where the decimal point falls among the significant digits.
    let lead_zeros = (whole.len() + fraction.len()) as i64 - digits.len() as i64;
    let point = whole.len() as i64 - lead_zeros + exponent;
    let n = digits.len().max(1) as i64;
    let plain = if point >= n {
        point
    } else if point > 0 {
        n + 1
    } else {
        2 + -point + n
    };
    sign + plain.max(1) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_nul_is_found_in_strings_and_keys_with_its_path() {
        assert_eq!(
            nul_at(&json!({"a": ["ok", "b\u{0}d"]})),
            Some("/a/1".into())
        );
        assert_eq!(nul_at(&json!({"x/y\u{0}": 1})), Some("/x~1y\u{0}".into()));
        assert_eq!(nul_at(&json!("\u{0}")), Some(String::new()));
        assert_eq!(nul_at(&json!({"a": [1, "two", {"b": null}]})), None);
    }

    #[test]
    fn lengths_are_those_postgres_prints() {
        // Each checked against `SELECT octet_length('<json>'::jsonb::text)` on PostgreSQL 15.
        assert_eq!(
            text_len(&json!({"a": 1, "b": [1, 2]})),
            r#"{"a": 1, "b": [1, 2]}"#.len()
        );
        assert_eq!(text_len(&json!(1e300)), 301);
        assert_eq!(text_len(&json!(-1.5e-7)), "-0.00000015".len());
        assert_eq!(text_len(&json!(1.2345e20)), 21);
        assert_eq!(text_len(&json!(12.5)), 4);
        assert_eq!(text_len(&json!("é\n")), "\"é\\n\"".len());
    }
}
