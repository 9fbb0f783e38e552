//! Bearer tokens: HS256 JWTs with `sub` (user), `workspace_id` and `exp` (CONTRACT.md §2).
//!
//! The workspace comes from the token only. Only HS256 is accepted: `alg: none` and every other algorithm fail.

use std::time::Duration;

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::config::Secret;
use conveyor_jobs::{UserId, WorkspaceId};

/// The claims Conveyor reads.
#[derive(Debug, Serialize, Deserialize)]
pub struct Claims {
    /// The user.
    pub sub: Uuid,
    /// The tenant.
    pub workspace_id: Uuid,
    /// Expiry, seconds since the epoch.
    pub exp: u64,
    /// Issued at, seconds since the epoch.
    #[serde(default)]
    pub iat: u64,
}

pub use conveyor_shop::Principal;

/// Why a token was refused. The reason is for logs; clients get one generic answer.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// Past its `exp`.
    #[error("token expired")]
    Expired,
    /// Bad signature, algorithm, shape or claims.
    #[error("token invalid: {0}")]
    Invalid(String),
}

/// Verifies and mints tokens with the configured secret (and, while a rotation lasts, the one it replaces).
#[derive(Clone)]
pub struct TokenKeys {
    encoding: EncodingKey,
    /// The current key first, then the previous one.
    decoding: Vec<DecodingKey>,
    validation: Validation,
}

impl TokenKeys {
    /// Keys over the HS256 secret.
    pub fn new(secret: &Secret<Vec<u8>>) -> Self {
        Self::rotating(secret, None)
    }

    /// Keys that mint with `current` and accept tokens signed with `current` or `previous` (a rotation: tokens
    /// minted before it keep working until they expire, then `previous` is dropped).
    pub fn rotating(current: &Secret<Vec<u8>>, previous: Option<&Secret<Vec<u8>>>) -> Self {
        let mut validation = Validation::new(Algorithm::HS256);
        validation.leeway = 5;
        validation.set_required_spec_claims(&["exp", "sub"]);
        let decoding = std::iter::once(current)
            .chain(previous)
            .map(|s| DecodingKey::from_secret(s.expose()).expect("an HMAC key of any length is valid"))
            .collect();
        Self {
            encoding: EncodingKey::from_secret(current.expose()).expect("an HMAC key of any length is valid"),
            decoding,
            validation,
        }
    }

    /// Keys of a process that verifies no token (every role but the api): a random secret that nobody holds, so
    /// that every token is refused.
    pub(crate) fn refusing_all() -> Self {
        let secret: [u8; 32] = rand::random();
        Self::new(&Secret::new(secret.to_vec()))
    }

    /// Verifies a bearer token and returns the caller.
    pub fn verify(&self, token: &str) -> Result<Principal, TokenError> {
        let mut first = None;
        for key in &self.decoding {
            match jsonwebtoken::decode::<Claims>(token, key, &self.validation) {
                Ok(data) => {
                    return Ok(Principal {
                        workspace_id: WorkspaceId(data.claims.workspace_id),
                        user_id: UserId(data.claims.sub),
                    });
                }
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        Err(match first.map(|e| e.into_kind()) {
            Some(jsonwebtoken::errors::ErrorKind::ExpiredSignature) => TokenError::Expired,
            kind => TokenError::Invalid(format!("{kind:?}")),
        })
    }

    /// Mints a token for `principal`, valid for `ttl` (development and tests).
    pub fn mint(&self, principal: Principal, ttl: Duration) -> String {
        let now = chrono::Utc::now().timestamp().max(0) as u64;
        let claims = Claims {
            sub: principal.user_id.0,
            workspace_id: principal.workspace_id.0,
            exp: now + ttl.as_secs(),
            iat: now,
        };
        jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &self.encoding)
            .expect("HS256 signing of serializable claims cannot fail")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> Secret<Vec<u8>> {
        Secret::new(s.as_bytes().to_vec())
    }

    #[test]
    fn a_rotation_accepts_tokens_of_the_previous_key_until_it_is_dropped_and_mints_with_the_new_one() {
        let (old, new) =
            (secret("the-old-workspace-token-key-of-32-bytes"), secret("the-new-workspace-token-key-of-32-bytes"));
        let who = Principal { workspace_id: WorkspaceId(Uuid::new_v4()), user_id: UserId(Uuid::new_v4()) };
        let before = TokenKeys::new(&old).mint(who, Duration::from_secs(600));
        let rotating = TokenKeys::rotating(&new, Some(&old));
        assert_eq!(rotating.verify(&before).unwrap(), who, "a token minted before the rotation still passes");
        let after = rotating.mint(who, Duration::from_secs(600));
        assert_eq!(TokenKeys::new(&new).verify(&after).unwrap(), who, "new tokens are signed with the new key");
        assert!(TokenKeys::new(&new).verify(&before).is_err(), "once the old key is dropped, its tokens fail");
        assert!(TokenKeys::refusing_all().verify(&after).is_err());
        assert!(matches!(TokenKeys::refusing_all().verify(&before), Err(TokenError::Invalid(_))));
    }
}
