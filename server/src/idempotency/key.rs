//! The `Idempotency-Key` header: a UUID, bare or as a quoted structured-field string.

use uuid::Uuid;

/// A valid idempotency key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(pub Uuid);

/// Why a header is not a key.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("Idempotency-Key must be a UUID, bare or as a quoted string")]
pub struct InvalidKey;

impl IdempotencyKey {
    /// Parses a header value: `8f421c70-…` or `"8f421c70-…"` (RFC 8941 sf-string), surrounding spaces allowed.
    pub fn parse(raw: &str) -> Result<Self, InvalidKey> {
        let raw = raw.trim_matches(|c| c == ' ' || c == '\t');
        let inner = match raw.strip_prefix('"') {
            Some(rest) => rest.strip_suffix('"').ok_or(InvalidKey)?,
            None => raw,
        };
        // Only the hyphenated form (any case); braces, urn: prefixes and the simple form are refused.
        if inner.len() != 36 {
            return Err(InvalidKey);
        }
        Uuid::try_parse(inner).map(Self).map_err(|_| InvalidKey)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_and_quoted_uuids_are_keys() {
        let id = "8f421c70-2f6e-4c1a-9a39-5b0f3f0f7d11";
        assert_eq!(IdempotencyKey::parse(id).unwrap().0.to_string(), id);
        assert_eq!(IdempotencyKey::parse(&format!("\"{id}\"")).unwrap().0.to_string(), id);
        assert_eq!(IdempotencyKey::parse(&id.to_uppercase()).unwrap().0.to_string(), id);
    }

    #[test]
    fn anything_else_is_invalid() {
        for raw in [
            "",
            "abc",
            "\"8f421c70-2f6e-4c1a-9a39-5b0f3f0f7d11",
            "8f421c702f6e4c1a9a395b0f3f0f7d11",
            "{8f421c70-2f6e-4c1a-9a39-5b0f3f0f7d11}",
            "8f421c70-2f6e-4c1a-9a39-5b0f3f0f7d1z",
            "\"\"",
        ] {
            assert_eq!(IdempotencyKey::parse(raw), Err(InvalidKey), "{raw}");
        }
    }
}
