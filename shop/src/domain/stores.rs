//! Store authorizations: a store of a workspace on a marketplace, with credentials sealed at rest.
//!
//! Creating a store or replacing its credentials writes, in the caller's transaction: the store, its sealed
//! credentials, a `queued` operation and a `store.verify_credentials` outbox event that names ids only.

use std::collections::BTreeMap;
use std::fmt;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::ValidationError;
use crate::Principal;
use crate::jobs::VerifyCredentials;
use crate::sealing::Sealer;
use conveyor_jobs::Operation;
use conveyor_jobs::WorkspaceTx;
use conveyor_jobs::{EnqueueError, EnqueueOptions};

/// Marketplaces Conveyor can verify credentials against.
pub const PLATFORMS: &[&str] = &["sandbox"];

/// The operation kind (and job kind) of a verification.
pub const VERIFY_KIND: &str = <VerifyCredentials as conveyor_jobs::JobKind>::KIND;

/// Submitted credentials: an object of string values. Never printed, never echoed, stored sealed only.
#[derive(Clone, Deserialize)]
#[serde(transparent)]
pub struct Credentials(BTreeMap<String, String>);

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

impl Drop for Credentials {
    fn drop(&mut self) {
        use zeroize::Zeroize;
        for value in self.0.values_mut() {
            value.zeroize();
        }
    }
}

impl Credentials {
    /// Checks the shape: 1 to 32 fields, names `[a-z0-9_]{1,64}`, values 1 to 4096 bytes.
    pub fn validate(&self) -> Result<(), ValidationError> {
        if self.0.is_empty() || self.0.len() > 32 {
            return Err(ValidationError("credentials must hold between 1 and 32 fields".into()));
        }
        for (name, value) in &self.0 {
            let name_ok = (1..=64).contains(&name.len())
                && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
            if !name_ok {
                return Err(ValidationError("credential field names must match [a-z0-9_]{1,64}".into()));
            }
            if value.is_empty() || value.len() > 4096 {
                return Err(ValidationError(format!("credential field `{name}` must be 1 to 4096 bytes long")));
            }
        }
        Ok(())
    }

    /// The fields, for the one adapter call that needs them.
    pub fn fields(&self) -> &BTreeMap<String, String> {
        &self.0
    }

    fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(&self.0).expect("a string map serializes")
    }

    /// Parses opened (decrypted) credentials.
    pub fn from_json(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes).map(Self)
    }
}

/// A store as clients see it (no credentials, ever).
#[derive(Clone, Debug, Serialize, sqlx::FromRow)]
pub struct Store {
    /// Id.
    pub id: Uuid,
    /// Display name.
    pub name: String,
    /// Marketplace.
    pub platform: String,
    /// `pending_verification`, `active` or `invalid_credentials`.
    pub status: String,
    /// Why the last verification failed, if it did (safe text).
    pub status_detail: Option<String>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
    /// Last successful verification.
    pub verified_at: Option<DateTime<Utc>>,
}

macro_rules! columns {
    () => {
        "id, name, platform, status, status_detail, created_at, updated_at, verified_at"
    };
}

/// A new store authorization.
#[derive(Debug)]
pub struct NewStore {
    /// Display name, 1 to 200 characters.
    pub name: String,
    /// One of [`PLATFORMS`].
    pub platform: String,
    /// The marketplace credentials.
    pub credentials: Credentials,
}

impl NewStore {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), ValidationError> {
        let name = self.name.trim();
        if name.is_empty() || name.chars().count() > 200 {
            return Err(ValidationError("name must be 1 to 200 characters".into()));
        }
        if !PLATFORMS.contains(&self.platform.as_str()) {
            return Err(ValidationError(format!("platform must be one of: {}", PLATFORMS.join(", "))));
        }
        self.credentials.validate()
    }
}

/// A store and the operation that verifies it.
#[derive(Clone, Debug, Serialize)]
pub struct Authorization {
    /// The store.
    pub store: Store,
    /// The verification now queued.
    pub operation: Operation,
}

/// The associated data binding a store's sealed credentials to it.
pub fn credentials_aad(workspace_id: Uuid, store_id: Uuid) -> Vec<u8> {
    [workspace_id.as_bytes().as_slice(), store_id.as_bytes()].concat()
}

async fn queue_verification_tx(
    tx: &mut WorkspaceTx,
    principal: &Principal,
    store_id: Uuid,
    credentials_version: i32,
    trace: Option<conveyor_jobs::TraceContext>,
) -> Result<Operation, sqlx::Error> {
    let operation =
        conveyor_jobs::create_operation_tx(tx, principal.workspace_id, principal.user_id, VERIFY_KIND, Some(store_id))
            .await?;
    let mut options = EnqueueOptions::new().operation(operation.id);
    if let Some(trace) = trace {
        options = options.trace(trace);
    }
    conveyor_jobs::enqueue_tx(tx, &VerifyCredentials { store_id, credentials_version }, options).await.map_err(
        |e| match e {
            EnqueueError::Database(e) => e,
            // A fixed kind with valid options and a payload of ids: none of these can happen.
            other => sqlx::Error::Protocol(other.to_string()),
        },
    )?;
    Ok(operation)
}

/// Creates a store with sealed credentials, a queued verification operation and its outbox event.
pub async fn create_tx(
    tx: &mut WorkspaceTx,
    principal: &Principal,
    sealer: &Sealer,
    new: NewStore,
    trace: Option<conveyor_jobs::TraceContext>,
) -> Result<Authorization, sqlx::Error> {
    let id = Uuid::now_v7();
    let store = sqlx::query_as::<_, Store>(concat!(
        "INSERT INTO conveyor_shop.stores (id, workspace_id, name, platform, created_by) VALUES ($1, $2, $3, $4, $5) RETURNING ",
        columns!()
    ))
    .bind(id)
    .bind(principal.workspace_id.0)
    .bind(new.name.trim())
    .bind(&new.platform)
    .bind(principal.user_id.0)
    .fetch_one(&mut **tx)
    .await?;
    let sealed = sealer.seal(&new.credentials.to_json(), &credentials_aad(principal.workspace_id.0, id));
    sqlx::query(
        "INSERT INTO conveyor_shop.store_credentials (store_id, workspace_id, key_id, nonce, ciphertext) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(id)
    .bind(principal.workspace_id.0)
    .bind(&sealed.key_id)
    .bind(&sealed.nonce)
    .bind(&sealed.ciphertext)
    .execute(&mut **tx)
    .await?;
    let operation = queue_verification_tx(tx, principal, id, 1, trace).await?;
    Ok(Authorization { store, operation })
}

/// Replaces a store's credentials and queues a new verification. `None` when the workspace has no such store.
pub async fn replace_credentials_tx(
    tx: &mut WorkspaceTx,
    principal: &Principal,
    sealer: &Sealer,
    store_id: Uuid,
    credentials: Credentials,
    trace: Option<conveyor_jobs::TraceContext>,
) -> Result<Option<Authorization>, sqlx::Error> {
    let store = sqlx::query_as::<_, Store>(concat!(
        "UPDATE conveyor_shop.stores SET status = 'pending_verification', status_detail = NULL, updated_at = now()
         WHERE id = $1 RETURNING ",
        columns!()
    ))
    .bind(store_id)
    .fetch_optional(&mut **tx)
    .await?;
    let Some(store) = store else { return Ok(None) };
    let sealed = sealer.seal(&credentials.to_json(), &credentials_aad(principal.workspace_id.0, store_id));
    let (version,): (i32,) = sqlx::query_as(
        "UPDATE conveyor_shop.store_credentials SET key_id = $2, nonce = $3, ciphertext = $4, version = version + 1, updated_at = now()
         WHERE store_id = $1 RETURNING version",
    )
    .bind(store_id)
    .bind(&sealed.key_id)
    .bind(&sealed.nonce)
    .bind(&sealed.ciphertext)
    .fetch_one(&mut **tx)
    .await?;
    let operation = queue_verification_tx(tx, principal, store_id, version, trace).await?;
    Ok(Some(Authorization { store, operation }))
}

/// The store `id` of the transaction's workspace, if any.
pub async fn get_tx(tx: &mut WorkspaceTx, id: Uuid) -> Result<Option<Store>, sqlx::Error> {
    sqlx::query_as::<_, Store>(concat!("SELECT ", columns!(), " FROM conveyor_shop.stores WHERE id = $1"))
        .bind(id)
        .fetch_optional(&mut **tx)
        .await
}

/// What a verification found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum VerifyOutcome {
    /// The marketplace accepted the credentials: the store is `active`.
    Active,
    /// The marketplace refused them: the store is `invalid_credentials`.
    InvalidCredentials,
    /// Newer credentials were submitted since; their own verification decides.
    Superseded {
        /// The current credentials version.
        current_version: i32,
    },
    /// The store no longer exists.
    StoreGone,
}

/// Why a verification could not finish.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// The marketplace is unavailable: worth retrying.
    #[error(transparent)]
    Marketplace(#[from] crate::adapters::marketplace::MarketplaceError),
    /// The sealed credentials do not open (wrong key, tampering): retrying cannot help.
    #[error("stored credentials could not be opened")]
    Unreadable,
    /// PostgreSQL failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Verifies version `version` of a store's credentials with its marketplace and records the result, in the job's
/// transaction. `token` (the operation id) is the marketplace's idempotency token, so a repeat is one effect.
pub async fn verify_tx(
    tx: &mut WorkspaceTx,
    sealer: &Sealer,
    marketplace: &dyn crate::adapters::marketplace::Marketplace,
    workspace_id: Uuid,
    store_id: Uuid,
    version: i32,
    token: &str,
) -> Result<VerifyOutcome, VerifyError> {
    use crate::adapters::marketplace::Verification;
    let row: Option<(i32, Vec<u8>, Vec<u8>)> = sqlx::query_as(
        "SELECT c.version, c.nonce, c.ciphertext
         FROM conveyor_shop.stores s JOIN conveyor_shop.store_credentials c ON c.store_id = s.id
         WHERE s.id = $1 FOR UPDATE OF s",
    )
    .bind(store_id)
    .fetch_optional(&mut **tx)
    .await?;
    let Some((current_version, nonce, ciphertext)) = row else { return Ok(VerifyOutcome::StoreGone) };
    if current_version != version {
        return Ok(VerifyOutcome::Superseded { current_version });
    }
    let plain = sealer
        .open(&nonce, &ciphertext, &credentials_aad(workspace_id, store_id))
        .map_err(|_| VerifyError::Unreadable)?;
    let credentials = Credentials::from_json(&plain).map_err(|_| VerifyError::Unreadable)?;
    let verification = marketplace.verify_credentials(token, credentials.fields()).await?;
    let (status, detail, outcome) = match verification {
        Verification::Valid => ("active", None, VerifyOutcome::Active),
        Verification::Invalid => {
            ("invalid_credentials", Some("the marketplace rejected the credentials"), VerifyOutcome::InvalidCredentials)
        }
    };
    sqlx::query(
        "UPDATE conveyor_shop.stores SET status = $2, status_detail = $3, updated_at = now(),
                verified_at = CASE WHEN $2 = 'active' THEN now() ELSE verified_at END
         WHERE id = $1",
    )
    .bind(store_id)
    .bind(status)
    .bind(detail)
    .execute(&mut **tx)
    .await?;
    Ok(outcome)
}

/// Why a store's credentials cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    /// No such store in the workspace.
    #[error("store not found")]
    StoreGone,
    /// The sealed credentials do not open (wrong key, tampering): retrying cannot help.
    #[error("stored credentials could not be opened")]
    Unreadable,
    /// PostgreSQL failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Opens the current credentials of store `store_id`, for the one adapter call that needs them.
pub async fn open_credentials_tx(
    tx: &mut WorkspaceTx,
    sealer: &Sealer,
    workspace_id: Uuid,
    store_id: Uuid,
) -> Result<Credentials, CredentialsError> {
    let row: Option<(Vec<u8>, Vec<u8>)> =
        sqlx::query_as("SELECT nonce, ciphertext FROM conveyor_shop.store_credentials WHERE store_id = $1")
            .bind(store_id)
            .fetch_optional(&mut **tx)
            .await?;
    let (nonce, ciphertext) = row.ok_or(CredentialsError::StoreGone)?;
    let plain = sealer
        .open(&nonce, &ciphertext, &credentials_aad(workspace_id, store_id))
        .map_err(|_| CredentialsError::Unreadable)?;
    Credentials::from_json(&plain).map_err(|_| CredentialsError::Unreadable)
}
