//! The operator UI's session: a signed, expiring cookie naming the actor, and the CSRF token bound to it.
//!
//! In brief: `POST /ui/login` checks the operator credential once and sets `conveyor_ui=<sid>.<exp>.<actor>.<mac>`,
//! where `sid` is 16 random bytes, `exp` the expiry (Unix seconds), `actor` the actor's name (base64url) and `mac`
//! an HMAC-SHA256 of the rest. The credential itself is never stored in the cookie. The key is derived from
//! `CONVEYOR_OPERATOR_JWT_SECRET` and `CONVEYOR_ADMIN_TOKEN`, so every replica accepts the same sessions and rotating either
//! secret ends them all. A form's CSRF token is an HMAC of the session id under a separate label: a page of another
//! origin can neither read it nor compute it.
//!
//! A session never outlives the credential that started it: it ends [`SESSION_TTL`] after login, or when the operator
//! JWT it was started with expires, whichever comes first (the shared operator token has no expiry of its own).
//!
//! Sessions are stateless: logging out clears the browser's cookie; a copied cookie stays valid until it expires or a
//! secret rotates.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::HeaderMap;
use axum::http::header::{COOKIE, HOST};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

use crate::config::Secret;
use crate::http::AppState;
use conveyor_jobs::Actor;

/// The session cookie's name.
pub const COOKIE_NAME: &str = "conveyor_ui";

/// How long a session lasts after login at most.
pub const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);

const SESSION_LABEL: &[u8] = b"conveyor-ui-session:";
const CSRF_LABEL: &[u8] = b"conveyor-ui-csrf:";

type HmacSha256 = Hmac<Sha256>;

/// The key that signs sessions and CSRF tokens.
#[derive(Clone)]
pub struct SessionKey(Secret<Vec<u8>>);

impl SessionKey {
    /// Derives the key from the operator's secrets, never the workspace tokens' key: HMAC-SHA256 keyed by the
    /// operator JWT secret (when set) over a fixed label and the operator token (when set). With neither, nobody can
    /// log in, and the key is random.
    pub fn derive(admin_token: Option<&Secret<String>>, operator_jwt_secret: Option<&Secret<Vec<u8>>>) -> Self {
        if admin_token.is_none() && operator_jwt_secret.is_none() {
            let random: [u8; 32] = rand::random();
            return Self(Secret::new(random.to_vec()));
        }
        let mut mac = mac_with(operator_jwt_secret.map_or(&b"conveyor-ui"[..], |s| s.expose()));
        mac.update(b"conveyor-ui-session-key-v2\0");
        if let Some(token) = admin_token {
            mac.update(token.expose().as_bytes());
        }
        Self(Secret::new(mac.finalize().into_bytes().to_vec()))
    }

    fn mac(&self, label: &[u8], data: &[u8]) -> HmacSha256 {
        let mut mac = mac_with(self.0.expose());
        mac.update(label);
        mac.update(data);
        mac
    }
}

fn mac_with(key: &[u8]) -> HmacSha256 {
    <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC takes a key of any length")
}

/// A verified session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Session {
    /// Its random id (hex).
    pub id: String,
    /// Who logged in.
    pub actor: Actor,
    /// When it ends, Unix seconds.
    pub expires_at: u64,
}

impl Session {
    /// A new session for `actor`, ending [`SESSION_TTL`] from now or when its credential does (`credential_expiry`,
    /// Unix seconds: an operator JWT's `exp`), whichever is sooner. `None` when that leaves no time at all (a JWT
    /// accepted within its clock leeway after it expired).
    pub fn start(actor: Actor, credential_expiry: Option<u64>) -> Option<Self> {
        let now = now();
        let expires_at =
            credential_expiry.map_or(now + SESSION_TTL.as_secs(), |exp| exp.min(now + SESSION_TTL.as_secs()));
        if expires_at <= now {
            return None;
        }
        let mut id = [0u8; 16];
        rand::rng().fill_bytes(&mut id);
        let id = id.iter().map(|b| format!("{b:02x}")).collect();
        Some(Self { id, actor, expires_at })
    }

    /// Seconds until the session ends (0 once it has).
    pub fn remaining(&self) -> u64 {
        self.expires_at.saturating_sub(now())
    }

    /// The cookie value: the session and its signature.
    pub fn encode(&self, key: &SessionKey) -> String {
        let payload = format!("{}.{}.{}", self.id, self.expires_at, B64.encode(self.actor.0.as_bytes()));
        let mac = key.mac(SESSION_LABEL, payload.as_bytes()).finalize().into_bytes();
        format!("{payload}.{}", B64.encode(mac))
    }

    /// The session in `value` when its signature holds and it has not expired.
    pub fn decode(key: &SessionKey, value: &str) -> Option<Self> {
        let (payload, mac) = value.rsplit_once('.')?;
        let mac = B64.decode(mac).ok()?;
        key.mac(SESSION_LABEL, payload.as_bytes()).verify_slice(&mac).ok()?;
        let mut parts = payload.splitn(3, '.');
        let (id, expires_at, actor) = (parts.next()?, parts.next()?, parts.next()?);
        let expires_at: u64 = expires_at.parse().ok()?;
        if expires_at <= now() {
            return None;
        }
        let actor = String::from_utf8(B64.decode(actor).ok()?).ok()?;
        Some(Self { id: id.to_owned(), actor: Actor(actor), expires_at })
    }

    /// The CSRF token every form of this session carries.
    pub fn csrf_token(&self, key: &SessionKey) -> String {
        B64.encode(key.mac(CSRF_LABEL, self.id.as_bytes()).finalize().into_bytes())
    }

    /// Whether `token` is this session's CSRF token (compared in constant time).
    pub fn csrf_matches(&self, key: &SessionKey, token: &str) -> bool {
        B64.decode(token).is_ok_and(|mac| key.mac(CSRF_LABEL, self.id.as_bytes()).verify_slice(&mac).is_ok())
    }
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The value of the session cookie among the request's `Cookie` headers.
fn cookie_value(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE_NAME)
        .map(|(_, value)| value.trim_matches('"'))
}

/// The valid session the request's cookie carries, if any.
pub fn session_from_cookie(state: &AppState, headers: &HeaderMap) -> Option<Session> {
    Session::decode(&state.ui_sessions, cookie_value(headers)?)
}

/// The actor of the valid UI session the request's cookie carries, if any (for the admin API to accept the session
/// as well; a state-changing call authenticated this way must also check CSRF, see [`Session::csrf_matches`]).
pub fn actor_from_cookie(state: &AppState, headers: &HeaderMap) -> Option<Actor> {
    session_from_cookie(state, headers).map(|s| s.actor)
}

/// Whether the browser reached the UI at a loopback host (`localhost`, `127.0.0.0/8`, `[::1]`) without a proxy
/// saying the original request was HTTPS.
fn plain_loopback(headers: &HeaderMap) -> bool {
    let forwarded_https = headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').next().is_some_and(|p| p.trim().eq_ignore_ascii_case("https")));
    if forwarded_https {
        return false;
    }
    let Some(host) = headers.get(HOST).and_then(|v| v.to_str().ok()) else { return false };
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The `Set-Cookie` value that starts `session`, kept by the browser until the session ends. `Secure` is always set,
/// except when the browser addressed the UI by a loopback host over plain HTTP (a port-forward or a local run: the
/// cookie never leaves the machine, and a browser may refuse a `Secure` cookie there).
pub fn set_cookie(key: &SessionKey, session: &Session, headers: &HeaderMap) -> String {
    format!(
        "{COOKIE_NAME}={}; Path=/ui; Max-Age={}; HttpOnly; SameSite=Strict{}",
        session.encode(key),
        session.remaining(),
        if plain_loopback(headers) { "" } else { "; Secure" }
    )
}

/// The `Set-Cookie` value that ends the session in the browser.
pub fn clear_cookie(headers: &HeaderMap) -> String {
    format!(
        "{COOKIE_NAME}=; Path=/ui; Max-Age=0; HttpOnly; SameSite=Strict{}",
        if plain_loopback(headers) { "" } else { "; Secure" }
    )
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn key(token: &str) -> SessionKey {
        SessionKey::derive(Some(&Secret::new(token.to_owned())), Some(&Secret::new(b"operator-jwt-secret".to_vec())))
    }

    #[test]
    fn a_session_round_trips_and_names_the_actor_not_the_credential() {
        let key = key("the-operator-token");
        let session = Session::start(Actor("jwt:alice".into()), None).unwrap();
        let value = session.encode(&key);
        assert!(!value.contains("the-operator-token"));
        assert_eq!(Session::decode(&key, &value), Some(session));
    }

    #[test]
    fn a_tampered_expired_or_foreign_session_is_refused() {
        let key = key("the-operator-token");
        let session = Session::start(Actor("token".into()), None).unwrap();
        let value = session.encode(&key);
        // Another actor under the same signature.
        let forged = value.replacen(&B64.encode("token"), &B64.encode("jwt:mallory"), 1);
        assert_ne!(forged, value);
        assert_eq!(Session::decode(&key, &forged), None);
        // Signed by another key (the token rotated).
        assert_eq!(Session::decode(&self::key("a-rotated-token"), &value), None);
        // Expired.
        let old = Session { expires_at: now() - 1, ..session };
        assert_eq!(Session::decode(&key, &old.encode(&key)), None);
        assert_eq!(Session::decode(&key, "garbage"), None);
        assert_eq!(Session::decode(&key, ""), None);
    }

    #[test]
    fn a_session_ends_no_later_than_the_credential_that_started_it() {
        let key = key("t");
        let start = now();
        // The shared token has no expiry: the full session.
        let token = Session::start(Actor("token".into()), None).unwrap();
        assert!((start + SESSION_TTL.as_secs()..=now() + SESSION_TTL.as_secs()).contains(&token.expires_at));
        // A JWT that expires in five minutes: a five-minute session, and a cookie the browser drops then.
        let soon = start + 300;
        let jwt = Session::start(Actor("jwt:alice".into()), Some(soon)).unwrap();
        assert_eq!(jwt.expires_at, soon);
        assert_eq!(Session::decode(&key, &jwt.encode(&key)).map(|s| s.expires_at), Some(soon));
        let cookie = set_cookie(&key, &jwt, &HeaderMap::new());
        let max_age: u64 = cookie.split("Max-Age=").nth(1).unwrap().split(';').next().unwrap().parse().unwrap();
        assert!(max_age <= 300, "{cookie}");
        // A JWT valid for days: still at most the session's own lifetime.
        let later = Session::start(Actor("jwt:alice".into()), Some(start + 7 * 86_400)).unwrap();
        assert!(later.expires_at <= now() + SESSION_TTL.as_secs());
        // Already expired (accepted within the leeway): no session.
        assert_eq!(Session::start(Actor("jwt:alice".into()), Some(start - 1)), None);
        assert_eq!(Session::start(Actor("jwt:alice".into()), Some(start)), None);
    }

    #[test]
    fn the_csrf_token_is_bound_to_its_session() {
        let key = key("the-operator-token");
        let (a, b) = (
            Session::start(Actor("token".into()), None).unwrap(),
            Session::start(Actor("token".into()), None).unwrap(),
        );
        assert!(a.csrf_matches(&key, &a.csrf_token(&key)));
        assert!(!a.csrf_matches(&key, &b.csrf_token(&key)));
        assert!(!a.csrf_matches(&key, ""));
        assert!(!a.csrf_matches(&key, "not base64 !"));
    }

    #[test]
    fn the_cookie_is_secure_except_on_plain_loopback() {
        let key = key("t");
        let session = Session::start(Actor("token".into()), None).unwrap();
        let with = |host: &str, proto: Option<&str>| {
            let mut headers = HeaderMap::new();
            headers.insert(HOST, HeaderValue::from_str(host).unwrap());
            if let Some(proto) = proto {
                headers.insert("x-forwarded-proto", HeaderValue::from_str(proto).unwrap());
            }
            set_cookie(&key, &session, &headers)
        };
        for local in ["127.0.0.1:9000", "localhost:9000", "[::1]:9000", "localhost"] {
            assert!(!with(local, None).contains("Secure"), "{local}");
        }
        assert!(with("127.0.0.1:9000", Some("https")).ends_with("; Secure"));
        assert!(with("conveyor.example.com", None).ends_with("; Secure"));
        assert!(with("10.0.0.7:9000", None).ends_with("; Secure"));
        let cookie = with("conveyor.example.com", None);
        assert!(cookie.contains("HttpOnly; SameSite=Strict") && cookie.contains("Path=/ui;"));
        let mut headers = HeaderMap::new();
        headers.insert(COOKIE, HeaderValue::from_str(&format!("a=b; {COOKIE_NAME}={}", session.encode(&key))).unwrap());
        assert_eq!(cookie_value(&headers).and_then(|v| Session::decode(&key, v)), Some(session));
    }
}
