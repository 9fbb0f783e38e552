//! Request fingerprints: HMAC-SHA256 with a server key over a canonical form of the request, so that a low-entropy
//! body (a short password, say) cannot be guessed offline from a stored fingerprint, and requests that mean the same
//! (keys reordered, white space, `1.0` for `1`) fingerprint the same.
//!
//! Canonical form, one part per line: method, normalized path, query pairs sorted, the headers that change meaning
//! (`content-type` media type, `if-match`, `if-none-match`, `prefer`) as sorted `name:value`, then the body as
//! canonical JSON (object keys sorted, no white space, integral numbers as integers).

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::config::FingerprintKey;

type HmacSha256 = Hmac<Sha256>;

/// Headers whose value changes what a request means, beside its body.
pub const SEMANTIC_HEADERS: &[&str] = &["if-match", "if-none-match", "prefer"];

/// A fingerprint and the id of the key that made it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fingerprint {
    /// The id of the signing key.
    pub key_id: String,
    /// HMAC-SHA256 of the canonical request.
    pub mac: Vec<u8>,
}

/// The request parts that take part in a fingerprint.
pub struct RequestParts<'a> {
    /// HTTP method.
    pub method: &'a str,
    /// Path as received.
    pub path: &'a str,
    /// Query string, if any.
    pub query: Option<&'a str>,
    /// `content-type` header.
    pub content_type: Option<&'a str>,
    /// Other headers as `(lower-case name, value)`; only [`SEMANTIC_HEADERS`] are used.
    pub headers: Vec<(&'a str, &'a str)>,
    /// The parsed JSON body, if any.
    pub body: Option<&'a serde_json::Value>,
}

/// Lower-cases UUID-shaped segments, drops empty segments and a trailing slash: `/v1/stores/ABC…/` → `/v1/stores/abc…`.
pub fn normalize_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for segment in path.split('/').filter(|s| !s.is_empty()) {
        out.push('/');
        match uuid::Uuid::try_parse(segment) {
            Ok(id) => out.push_str(&id.to_string()),
            Err(_) => out.push_str(segment),
        }
    }
    if out.is_empty() {
        out.push('/');
    }
    out
}

/// Writes `value` as canonical JSON.
pub fn canonical_json(value: &serde_json::Value, out: &mut String) {
    use serde_json::Value;
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                out.push_str(&i.to_string());
            } else if let Some(u) = n.as_u64() {
                out.push_str(&u.to_string());
            } else {
                let f = n.as_f64().unwrap_or(0.0);
                if f.fract() == 0.0 && f.abs() < 9.007_199_254_740_992e15 {
                    out.push_str(&(f as i64).to_string());
                } else {
                    out.push_str(&format!("{f:e}"));
                }
            }
        }
        Value::String(s) => out.push_str(&serde_json::to_string(s).expect("a string serializes")),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical_json(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::to_string(k).expect("a string serializes"));
                out.push(':');
                canonical_json(v, out);
            }
            out.push('}');
        }
    }
}

/// The canonical form of a request, the input of the HMAC.
pub fn canonical_request(parts: &RequestParts<'_>) -> String {
    let mut out = String::new();
    out.push_str(&parts.method.to_ascii_uppercase());
    out.push('\n');
    out.push_str(&normalize_path(parts.path));
    out.push('\n');
    let mut pairs: Vec<&str> = parts.query.unwrap_or("").split('&').filter(|p| !p.is_empty()).collect();
    pairs.sort_unstable();
    out.push_str(&pairs.join("&"));
    out.push('\n');
    let mut headers: Vec<String> = parts
        .headers
        .iter()
        .filter(|(name, _)| SEMANTIC_HEADERS.contains(name))
        .map(|(name, value)| format!("{name}:{}", value.trim()))
        .collect();
    if let Some(ct) = parts.content_type {
        let media = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
        headers.push(format!("content-type:{media}"));
    }
    headers.sort();
    out.push_str(&headers.join("\n"));
    out.push('\n');
    match parts.body {
        Some(body) => canonical_json(body, &mut out),
        None => out.push('-'),
    }
    out
}

/// Signs with the first configured key and verifies against all of them.
#[derive(Clone, Debug)]
pub struct Fingerprinter {
    keys: Vec<FingerprintKey>,
}

impl Fingerprinter {
    /// Over the configured keys; the first signs. Panics on an empty list (configuration guarantees one).
    pub fn new(keys: Vec<FingerprintKey>) -> Self {
        assert!(!keys.is_empty(), "at least one fingerprint key");
        Self { keys }
    }

    fn mac(key: &FingerprintKey, canonical: &str) -> Vec<u8> {
        let mut mac = HmacSha256::new_from_slice(key.secret.expose()).expect("HMAC takes keys of any length");
        mac.update(canonical.as_bytes());
        mac.finalize().into_bytes().to_vec()
    }

    /// Fingerprints a canonical request with the signing key.
    pub fn sign(&self, canonical: &str) -> Fingerprint {
        let key = &self.keys[0];
        Fingerprint { key_id: key.id.clone(), mac: Self::mac(key, canonical) }
    }

    /// Whether `stored` fingerprints `canonical` under any configured key (the stored key id is tried first), in
    /// constant time per comparison. A record made with a key no longer configured never matches.
    pub fn matches(&self, stored: &Fingerprint, canonical: &str) -> bool {
        let mut keys: Vec<&FingerprintKey> = self.keys.iter().filter(|k| k.id == stored.key_id).collect();
        keys.extend(self.keys.iter().filter(|k| k.id != stored.key_id));
        keys.into_iter().any(|key| {
            let mut mac = HmacSha256::new_from_slice(key.secret.expose()).expect("HMAC takes keys of any length");
            mac.update(canonical.as_bytes());
            mac.verify_slice(&stored.mac).is_ok()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Secret;
    use serde_json::json;

    fn key(id: &str, secret: &str) -> FingerprintKey {
        FingerprintKey { id: id.into(), secret: Secret::new(secret.as_bytes().to_vec()) }
    }

    fn canonical(body: &serde_json::Value) -> String {
        canonical_request(&RequestParts {
            method: "post",
            path: "/v1/stores/",
            query: None,
            content_type: Some("application/json; charset=utf-8"),
            headers: vec![],
            body: Some(body),
        })
    }

    #[test]
    fn key_order_white_space_and_number_forms_do_not_change_the_fingerprint() {
        let f = Fingerprinter::new(vec![key("a", "secret-a")]);
        let one: serde_json::Value = serde_json::from_str(r#"{"name":"Shop","n":1,"c":{"b":"2","a":"1"}}"#).unwrap();
        let two: serde_json::Value =
            serde_json::from_str("{ \"c\" : {\"a\":\"1\", \"b\":\"2\"},\n \"n\": 1.0, \"name\":\"Shop\" }").unwrap();
        assert_eq!(f.sign(&canonical(&one)), f.sign(&canonical(&two)));
        let changed: serde_json::Value =
            serde_json::from_str(r#"{"name":"Shop","n":2,"c":{"b":"2","a":"1"}}"#).unwrap();
        assert_ne!(f.sign(&canonical(&one)), f.sign(&canonical(&changed)));
        assert_ne!(f.sign(&canonical(&one)), f.sign(&canonical(&json!({"name": "Shop"}))));
    }

    #[test]
    fn semantic_headers_query_and_path_take_part() {
        let body = json!({"a": 1});
        let base = RequestParts {
            method: "PUT",
            path: "/x",
            query: Some("b=2&a=1"),
            content_type: None,
            headers: vec![],
            body: Some(&body),
        };
        let reordered = RequestParts { query: Some("a=1&b=2"), ..base_clone(&base) };
        assert_eq!(canonical_request(&base), canonical_request(&reordered));
        let with_if_match = RequestParts { headers: vec![("if-match", "\"3\"")], ..base_clone(&base) };
        assert_ne!(canonical_request(&base), canonical_request(&with_if_match));
        let with_other = RequestParts { headers: vec![("user-agent", "curl")], ..base_clone(&base) };
        assert_eq!(canonical_request(&base), canonical_request(&with_other));
    }

    fn base_clone<'a>(p: &RequestParts<'a>) -> RequestParts<'a> {
        RequestParts {
            method: p.method,
            path: p.path,
            query: p.query,
            content_type: p.content_type,
            headers: p.headers.clone(),
            body: p.body,
        }
    }

    #[test]
    fn paths_normalize_uuid_case_and_slashes() {
        assert_eq!(
            normalize_path("//v1/stores/8F421C70-2F6E-4C1A-9A39-5B0F3F0F7D11/authorization/"),
            "/v1/stores/8f421c70-2f6e-4c1a-9a39-5b0f3f0f7d11/authorization"
        );
    }

    #[test]
    fn after_rotation_old_fingerprints_still_verify_and_mismatches_still_show() {
        let old = Fingerprinter::new(vec![key("k1", "first-secret")]);
        let body = json!({"a": 1});
        let stored = old.sign(&canonical(&body));
        let rotated = Fingerprinter::new(vec![key("k2", "second-secret"), key("k1", "first-secret")]);
        assert_eq!(rotated.sign(&canonical(&body)).key_id, "k2");
        assert!(rotated.matches(&stored, &canonical(&body)));
        assert!(!rotated.matches(&stored, &canonical(&json!({"a": 2}))));
        let retired = Fingerprinter::new(vec![key("k2", "second-secret")]);
        assert!(!retired.matches(&stored, &canonical(&body)));
    }
}
