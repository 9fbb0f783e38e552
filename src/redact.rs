//! Error text for operators, made safe to store: credentials in URLs are removed and the length is bounded.
//! Used for `outbox_events.last_error` and dead-letter reasons.

/// Longest stored error text.
pub(crate) const MAX_LEN: usize = 500;

/// Removes `user:password@` from every URL in `text`, drops anything after `password=`/`token=`/`secret=`-like
/// parameters, and truncates to 500 characters.
pub fn redact(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(MAX_LEN));
    for (i, word) in text.split(' ').enumerate() {
        if i > 0 {
            out.push(' ');
        }
        out.push_str(&redact_word(word));
    }
    if out.chars().count() > MAX_LEN {
        out = out.chars().take(MAX_LEN).collect::<String>() + "…";
    }
    out
}

fn redact_word(word: &str) -> String {
    let mut word = word.to_owned();
    if let Some(scheme_end) = word.find("://") {
        let rest = &word[scheme_end + 3..];
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        if let Some(at) = rest[..authority_end].rfind('@') {
            word = format!("{}://[redacted]@{}", &word[..scheme_end], &rest[at + 1..]);
        }
    }
    let lower = word.to_ascii_lowercase();
    for marker in ["password=", "passwd=", "pwd=", "token=", "secret=", "api_key=", "apikey=", "key="] {
        if let Some(pos) = lower.find(marker) {
            return format!("{}[redacted]", &word[..pos + marker.len()]);
        }
    }
    word
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_credentials_and_secrets_their_values() {
        let r = redact("connect to redis://:hunter2@127.0.0.1:6390/0 failed; postgres://app:pw@db/x?password=abc");
        assert!(!r.contains("hunter2") && !r.contains("pw@") && !r.contains("abc"), "{r}");
        assert!(r.contains("redis://[redacted]@127.0.0.1:6390/0"), "{r}");
        assert_eq!(redact("plain words stay"), "plain words stay");
        assert!(redact(&"x".repeat(2000)).chars().count() <= MAX_LEN + 1);
    }
}
