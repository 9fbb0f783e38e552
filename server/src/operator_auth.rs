//! Who may operate: the shared operator token (`CONVEYOR_ADMIN_TOKEN`), compared in constant time, or an HS256 JWT
//! signed with the operator's own key (`CONVEYOR_OPERATOR_JWT_SECRET`, or the previous one while it rotates, never
//! the workspace tokens' key: configuration refuses the same key) for the audience `conveyor-operator` whose claims
//! carry `"operator": true` and no `workspace_id`. Without an operator key no JWT is accepted.

use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use subtle::ConstantTimeEq;

use conveyor_jobs::Actor;
use conveyor_jobs::Secret;

/// Checks operator credentials.
#[derive(Clone)]
pub struct OperatorAuth {
    token: Option<Secret<String>>,
    /// The operator keys, the current one first; empty when no operator JWT is accepted.
    jwt: Vec<DecodingKey>,
    validation: Validation,
}

/// The audience an operator JWT must name (`aud`).
pub const OPERATOR_AUDIENCE: &str = "conveyor-operator";

#[derive(Deserialize)]
struct OperatorClaims {
    sub: String,
    exp: u64,
    #[serde(default)]
    operator: bool,
    #[serde(default)]
    workspace_id: Option<serde::de::IgnoredAny>,
}

/// Why credentials were refused (for logs; callers answer 401 alike).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OperatorAuthError {
    /// Neither the operator token nor a valid operator JWT.
    #[error("not an operator credential")]
    Refused,
}

impl OperatorAuth {
    /// Accepts `token` (when set) and operator JWTs signed with one of `jwt_secrets` (the operator's keys, never the
    /// workspace tokens'; none: no JWT is accepted).
    pub fn new(token: Option<Secret<String>>, jwt_secrets: &[&Secret<Vec<u8>>]) -> Self {
        let mut validation = Validation::new(Algorithm::HS256);
        validation.leeway = 5;
        validation.set_required_spec_claims(&["exp", "sub", "aud"]);
        validation.set_audience(&[OPERATOR_AUDIENCE]);
        Self {
            token,
            jwt: jwt_secrets
                .iter()
                .map(|s| DecodingKey::from_secret(s.expose()).expect("an HMAC key of any length is valid"))
                .collect(),
            validation,
        }
    }

    /// The actor behind `credential` (a bearer token's value, or what the login form was given): `token` for the
    /// shared operator token, `jwt:<sub>` for an operator JWT.
    pub fn verify(&self, credential: &str) -> Result<Actor, OperatorAuthError> {
        self.verify_with_expiry(credential).map(|(actor, _)| actor)
    }

    /// [`Self::verify`], with when the credential stops being valid (seconds since the epoch): a JWT's `exp`, `None`
    /// for the shared token. A session started with a credential must end no later.
    pub fn verify_with_expiry(&self, credential: &str) -> Result<(Actor, Option<u64>), OperatorAuthError> {
        if let Some(token) = &self.token
            && bool::from(token.expose().as_bytes().ct_eq(credential.as_bytes()))
        {
            return Ok((Actor("token".to_owned()), None));
        }
        for key in &self.jwt {
            if let Ok(data) = jsonwebtoken::decode::<OperatorClaims>(credential, key, &self.validation)
                && data.claims.operator
                && data.claims.workspace_id.is_none()
            {
                return Ok((Actor(format!("jwt:{}", data.claims.sub)), Some(data.claims.exp)));
            }
        }
        Err(OperatorAuthError::Refused)
    }
}

#[cfg(test)]
mod tests {
    use std::time::{SystemTime, UNIX_EPOCH};

    use jsonwebtoken::{EncodingKey, Header};
    use serde_json::json;

    use super::*;

    const SECRET: &[u8] = b"a-test-jwt-secret-of-at-least-32-bytes!!";

    fn auth() -> OperatorAuth {
        OperatorAuth::new(
            Some(Secret::new("an-operator-token-of-32-bytes-or-more".to_owned())),
            &[&Secret::new(SECRET.to_vec())],
        )
    }

    fn jwt(claims: serde_json::Value) -> String {
        jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &EncodingKey::from_secret(SECRET).unwrap())
            .unwrap()
    }

    fn exp() -> u64 {
        SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() + 600
    }

    #[test]
    fn the_token_and_operator_jwts_pass_and_nothing_else_does() {
        let auth = auth();
        assert_eq!(auth.verify("an-operator-token-of-32-bytes-or-more"), Ok(Actor("token".into())));
        assert_eq!(auth.verify("an-operator-token-of-32-bytes-or-mor"), Err(OperatorAuthError::Refused));
        assert_eq!(auth.verify(""), Err(OperatorAuthError::Refused));
        let until = exp();
        let op = jwt(json!({"sub": "alice", "exp": until, "aud": OPERATOR_AUDIENCE, "operator": true}));
        assert_eq!(auth.verify(&op), Ok(Actor("jwt:alice".into())));
        assert_eq!(auth.verify_with_expiry(&op).unwrap().1, Some(until));
        // Without the operator audience, or naming a workspace, the operator claim alone is not enough.
        let no_aud = jwt(json!({"sub": "alice", "exp": exp(), "operator": true}));
        assert_eq!(auth.verify(&no_aud), Err(OperatorAuthError::Refused));
        let other_aud = jwt(json!({"sub": "alice", "exp": exp(), "aud": "shop", "operator": true}));
        assert_eq!(auth.verify(&other_aud), Err(OperatorAuthError::Refused));
        let tenant = jwt(
            json!({"sub": "bob", "exp": exp(), "aud": OPERATOR_AUDIENCE, "operator": true, "workspace_id": uuid::Uuid::nil()}),
        );
        assert_eq!(auth.verify(&tenant), Err(OperatorAuthError::Refused));
        // A workspace user's token (no operator claim), a false claim, an expired one: refused.
        let user = jwt(json!({"sub": "bob", "exp": exp(), "workspace_id": uuid::Uuid::nil()}));
        assert_eq!(auth.verify(&user), Err(OperatorAuthError::Refused));
        let no = jwt(json!({"sub": "bob", "exp": exp(), "aud": OPERATOR_AUDIENCE, "operator": false}));
        assert_eq!(auth.verify(&no), Err(OperatorAuthError::Refused));
        let old = jwt(json!({"sub": "alice", "exp": 1_000, "aud": OPERATOR_AUDIENCE, "operator": true}));
        assert_eq!(auth.verify(&old), Err(OperatorAuthError::Refused));
    }

    #[test]
    fn without_a_token_only_jwts_pass() {
        let auth = OperatorAuth::new(None, &[&Secret::new(SECRET.to_vec())]);
        assert_eq!(auth.verify(""), Err(OperatorAuthError::Refused));
        let op = jwt(json!({"sub": "alice", "exp": exp(), "aud": OPERATOR_AUDIENCE, "operator": true}));
        assert_eq!(auth.verify(&op), Ok(Actor("jwt:alice".into())));
        assert_eq!(auth.verify_with_expiry("a-guess").unwrap_err(), OperatorAuthError::Refused);
    }

    #[test]
    fn a_rotated_operator_key_is_accepted_beside_the_new_one_and_no_key_accepts_no_jwt() {
        let (old, new) =
            (Secret::new(SECRET.to_vec()), Secret::new(b"the-next-operator-key-of-32-bytes-or-more".to_vec()));
        let op = jwt(json!({"sub": "alice", "exp": exp(), "aud": OPERATOR_AUDIENCE, "operator": true}));
        assert_eq!(OperatorAuth::new(None, &[&new, &old]).verify(&op), Ok(Actor("jwt:alice".into())));
        assert_eq!(OperatorAuth::new(None, &[&new]).verify(&op), Err(OperatorAuthError::Refused));
        assert_eq!(OperatorAuth::new(None, &[]).verify(&op), Err(OperatorAuthError::Refused));
    }
}
