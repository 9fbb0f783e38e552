//! Listings: a product of a workspace (title, description, price, media) and its publication to the marketplace of
//! its store, as one marketplace product, ever.
//!
//! Publishing writes, in the caller's transaction and under row locks on the listing, its store and its media: the
//! listing's `listing.publish` operation, the operation and its outbox event. The first publication also fixes the
//! listing's `publication_key` (its operation's id), the marketplace idempotency key of every publication of the
//! listing. The job creates the product on the marketplace with that key and records the product's id in its own
//! transaction.
//!
//! A listing reads `publish_failed` when its publication's operation ended without success (refused by the
//! marketplace, out of attempts, canceled): the platform records those ends on the operation, in a transaction the
//! handler's writes do not survive, so the listing's status is derived from it rather than written twice. Such a
//! listing may be published again, by a new operation; since the key stays the listing's, a product the marketplace
//! made for a call whose answer was lost (a publication canceled mid-call) is the product the new publication gets back
//! and records. A publication that is queued, running or done answers `AlreadyPublished`; migration 0019 lets
//! `publish_operation_id` change only away from an operation that ended `failed` or `canceled`, and never the key or the
//! product.

use chrono::{DateTime, Utc};
use serde::{Serialize, Serializer};
use uuid::Uuid;

use super::ValidationError;
use super::stores::{Credentials, credentials_aad};
use crate::Principal;
use crate::adapters::marketplace::{Marketplace, MarketplaceError, NewProduct};
use crate::jobs::PublishListing;
use crate::sealing::Sealer;
use conveyor_jobs::Operation;
use conveyor_jobs::WorkspaceTx;
use conveyor_jobs::{EnqueueError, EnqueueOptions};

/// The operation kind (and job kind) of a publication.
pub const PUBLISH_KIND: &str = <PublishListing as conveyor_jobs::JobKind>::KIND;

/// Longest title, in characters.
pub const MAX_TITLE_CHARS: usize = 200;
/// Longest description, in characters.
pub const MAX_DESCRIPTION_CHARS: usize = 10_000;
/// Most media a listing names.
pub const MAX_MEDIA: usize = 20;
/// Most digits before the decimal point of a price.
const MAX_INTEGER_DIGITS: usize = 9;

/// Active ISO 4217 currency codes (funds and metals left out), sorted.
const CURRENCIES: &[&str] = &[
    "AED", "AFN", "ALL", "AMD", "ANG", "AOA", "ARS", "AUD", "AWG", "AZN", "BAM", "BBD", "BDT", "BGN", "BHD", "BIF",
    "BMD", "BND", "BOB", "BRL", "BSD", "BTN", "BWP", "BYN", "BZD", "CAD", "CDF", "CHF", "CLP", "CNY", "COP", "CRC",
    "CUP", "CVE", "CZK", "DJF", "DKK", "DOP", "DZD", "EGP", "ERN", "ETB", "EUR", "FJD", "FKP", "GBP", "GEL", "GHS",
    "GIP", "GMD", "GNF", "GTQ", "GYD", "HKD", "HNL", "HTG", "HUF", "IDR", "ILS", "INR", "IQD", "IRR", "ISK", "JMD",
    "JOD", "JPY", "KES", "KGS", "KHR", "KMF", "KPW", "KRW", "KWD", "KYD", "KZT", "LAK", "LBP", "LKR", "LRD", "LSL",
    "LYD", "MAD", "MDL", "MGA", "MKD", "MMK", "MNT", "MOP", "MRU", "MUR", "MVR", "MWK", "MXN", "MYR", "MZN", "NAD",
    "NGN", "NIO", "NOK", "NPR", "NZD", "OMR", "PAB", "PEN", "PGK", "PHP", "PKR", "PLN", "PYG", "QAR", "RON", "RSD",
    "RUB", "RWF", "SAR", "SBD", "SCR", "SDG", "SEK", "SGD", "SHP", "SLE", "SOS", "SRD", "SSP", "STN", "SVC", "SYP",
    "SZL", "THB", "TJS", "TMT", "TND", "TOP", "TRY", "TTD", "TWD", "TZS", "UAH", "UGX", "USD", "UYU", "UZS", "VED",
    "VES", "VND", "VUV", "WST", "XAF", "XCD", "XCG", "XOF", "XPF", "YER", "ZAR", "ZMW", "ZWG",
];
/// Those of [`CURRENCIES`] without a minor unit (the others have 2 digits, or 3 in [`THREE_DIGIT_CURRENCIES`]).
const ZERO_DIGIT_CURRENCIES: &[&str] =
    &["BIF", "CLP", "DJF", "GNF", "ISK", "JPY", "KMF", "KRW", "PYG", "RWF", "UGX", "VND", "VUV", "XAF", "XOF", "XPF"];
/// Those of [`CURRENCIES`] whose minor unit has 3 digits.
const THREE_DIGIT_CURRENCIES: &[&str] = &["BHD", "IQD", "JOD", "KWD", "LYD", "OMR", "TND"];

/// The digits of `code`'s minor unit, if `code` is an active ISO 4217 currency.
fn minor_unit_digits(code: &str) -> Option<u32> {
    CURRENCIES.binary_search(&code).ok()?;
    Some(if ZERO_DIGIT_CURRENCIES.contains(&code) {
        0
    } else if THREE_DIGIT_CURRENCIES.contains(&code) {
        3
    } else {
        2
    })
}

/// An exact price: minor units of an ISO 4217 currency (1250 for 12.50 EUR). Never a float.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Price {
    minor: i64,
    currency: String,
}

impl Price {
    /// Parses a positive decimal amount (`"12.50"`, `"12"`: up to 9 digits, then up to 2 decimals and no more than
    /// the currency has) and an active ISO 4217 code in upper case.
    pub fn parse(amount: &str, currency: &str) -> Result<Self, ValidationError> {
        let digits = minor_unit_digits(currency).ok_or_else(|| {
            ValidationError("price.currency must be an active ISO 4217 code in upper case, e.g. EUR".into())
        })?;
        let allowed = digits.min(2) as usize;
        let malformed = || {
            ValidationError(format!(
                "price.amount must be a decimal string with at most {MAX_INTEGER_DIGITS} digits before the point and \
                 at most {allowed} after it for {currency}, e.g. \"12.50\""
            ))
        };
        let (whole, fraction) = match amount.split_once('.') {
            Some((whole, fraction)) if !fraction.is_empty() => (whole, fraction),
            Some(_) => return Err(malformed()),
            None => (amount, ""),
        };
        let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        if whole.is_empty()
            || whole.len() > MAX_INTEGER_DIGITS
            || fraction.len() > allowed
            || !all_digits(whole)
            || !all_digits(fraction)
        {
            return Err(malformed());
        }
        let scale = 10_i64.pow(digits);
        let whole: i64 = whole.parse().map_err(|_| malformed())?;
        let mut padded = fraction.to_owned();
        padded.extend(std::iter::repeat_n('0', digits as usize - fraction.len()));
        let fraction: i64 = if padded.is_empty() { 0 } else { padded.parse().map_err(|_| malformed())? };
        let minor = whole * scale + fraction;
        if minor <= 0 {
            return Err(ValidationError("price.amount must be greater than zero".into()));
        }
        Ok(Self { minor, currency: currency.to_owned() })
    }

    /// A stored price (written by [`Price::parse`] before).
    fn from_stored(minor: i64, currency: String) -> Self {
        Self { minor, currency }
    }

    /// Minor units of the currency.
    pub fn minor(&self) -> i64 {
        self.minor
    }

    /// The ISO 4217 code.
    pub fn currency(&self) -> &str {
        &self.currency
    }

    /// The amount as a decimal string with the currency's digits (`"12.50"`, `"1200"` for JPY, `"1.250"` for BHD).
    pub fn amount(&self) -> String {
        let digits = minor_unit_digits(&self.currency).unwrap_or(2);
        if digits == 0 {
            return self.minor.to_string();
        }
        let scale = 10_i64.pow(digits);
        format!("{}.{:0width$}", self.minor / scale, self.minor % scale, width = digits as usize)
    }
}

impl Serialize for Price {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut price = serializer.serialize_struct("Price", 2)?;
        price.serialize_field("amount", &self.amount())?;
        price.serialize_field("currency", &self.currency)?;
        price.end()
    }
}

/// A new listing, checked with [`NewListing::validate`].
#[derive(Clone, Debug)]
pub struct NewListing {
    /// The store it will be published to (of the same workspace).
    pub store_id: Uuid,
    /// Title, 1 to [`MAX_TITLE_CHARS`] characters (trimmed).
    pub title: String,
    /// Description, up to [`MAX_DESCRIPTION_CHARS`] characters.
    pub description: String,
    /// Price.
    pub price: Price,
    /// Media of the same workspace, in order; at most [`MAX_MEDIA`], no repeats.
    pub media_ids: Vec<Uuid>,
}

impl NewListing {
    /// Checks every field that needs no database.
    pub fn validate(&self) -> Result<(), ValidationError> {
        let title = self.title.trim();
        if title.is_empty() || title.chars().count() > MAX_TITLE_CHARS {
            return Err(ValidationError(format!("title must be 1 to {MAX_TITLE_CHARS} characters")));
        }
        if self.description.chars().count() > MAX_DESCRIPTION_CHARS {
            return Err(ValidationError(format!("description must be at most {MAX_DESCRIPTION_CHARS} characters")));
        }
        if self.media_ids.len() > MAX_MEDIA {
            return Err(ValidationError(format!("media_ids may name at most {MAX_MEDIA} media")));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(repeated) = self.media_ids.iter().find(|id| !seen.insert(**id)) {
            return Err(ValidationError(format!("media_ids names {repeated} twice")));
        }
        Ok(())
    }
}

/// `draft`, `publishing`, `published` or `publish_failed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ListingStatus {
    /// Not published yet.
    Draft,
    /// Its publication is queued or running.
    Publishing,
    /// On the marketplace: `marketplace_product_id` is set.
    Published,
    /// Its publication ended without success (see `publish_error`); it may be published again.
    PublishFailed,
}

/// A listing as clients see it.
#[derive(Clone, Debug, Serialize)]
pub struct Listing {
    /// Id.
    pub id: Uuid,
    /// The store it is published to.
    pub store_id: Uuid,
    /// Where it stands.
    pub status: ListingStatus,
    /// Title.
    pub title: String,
    /// Description.
    pub description: String,
    /// Price.
    pub price: Price,
    /// Its media, in order.
    pub media_ids: Vec<Uuid>,
    /// The marketplace's id of its product, once published.
    pub marketplace_product_id: Option<String>,
    /// Its latest `listing.publish` operation, once publishing was asked for.
    pub publish_operation_id: Option<Uuid>,
    /// Why the publication failed (redacted), when it did.
    pub publish_error: Option<String>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
    /// Published.
    pub published_at: Option<DateTime<Utc>>,
}

#[derive(sqlx::FromRow)]
struct ListingRow {
    id: Uuid,
    store_id: Uuid,
    status: String,
    operation_status: Option<String>,
    operation_error: Option<String>,
    title: String,
    description: String,
    price_minor: i64,
    currency: String,
    media_ids: Vec<Uuid>,
    marketplace_product_id: Option<String>,
    publish_operation_id: Option<Uuid>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    published_at: Option<DateTime<Utc>>,
}

impl From<ListingRow> for Listing {
    fn from(row: ListingRow) -> Self {
        let ended_without_success =
            row.status == "publishing" && matches!(row.operation_status.as_deref(), Some("failed" | "canceled"));
        let status = match row.status.as_str() {
            "published" => ListingStatus::Published,
            "publishing" if ended_without_success => ListingStatus::PublishFailed,
            "publishing" => ListingStatus::Publishing,
            _ => ListingStatus::Draft,
        };
        let publish_error = ended_without_success.then(|| {
            row.operation_error.unwrap_or_else(|| format!("the publication was {}", row.operation_status.unwrap()))
        });
        Self {
            id: row.id,
            store_id: row.store_id,
            status,
            title: row.title,
            description: row.description,
            price: Price::from_stored(row.price_minor, row.currency),
            media_ids: row.media_ids,
            marketplace_product_id: row.marketplace_product_id,
            publish_operation_id: row.publish_operation_id,
            publish_error,
            created_at: row.created_at,
            updated_at: row.updated_at,
            published_at: row.published_at,
        }
    }
}

/// The listing `id` of the transaction's workspace, if any.
pub async fn get_tx(tx: &mut WorkspaceTx, id: Uuid) -> Result<Option<Listing>, sqlx::Error> {
    let row = sqlx::query_as::<_, ListingRow>(
        "SELECT l.id, l.store_id, l.status, o.status AS operation_status, o.error AS operation_error, l.title,
                l.description, l.price_minor, l.currency,
                ARRAY(SELECT m.media_id FROM conveyor_shop.listing_media m WHERE m.listing_id = l.id ORDER BY m.position)
                    AS media_ids,
                l.marketplace_product_id, l.publish_operation_id, l.created_at, l.updated_at, l.published_at
         FROM conveyor_shop.listings l LEFT JOIN conveyor.operations o ON o.id = l.publish_operation_id
         WHERE l.id = $1",
    )
    .bind(id)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(row.map(Listing::from))
}

/// Why a listing cannot be created.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// The workspace has no such store.
    #[error("store {0} does not exist in this workspace")]
    StoreNotFound(Uuid),
    /// The workspace has no such media.
    #[error("media {0} does not exist in this workspace")]
    MediaNotFound(Uuid),
    /// PostgreSQL failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Creates a `draft` listing of the principal's workspace.
pub async fn create_tx(tx: &mut WorkspaceTx, principal: &Principal, new: NewListing) -> Result<Listing, CreateError> {
    let store: Option<(Uuid,)> = sqlx::query_as("SELECT id FROM conveyor_shop.stores WHERE id = $1")
        .bind(new.store_id)
        .fetch_optional(&mut **tx)
        .await?;
    if store.is_none() {
        return Err(CreateError::StoreNotFound(new.store_id));
    }
    if !new.media_ids.is_empty() {
        let found: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM conveyor_shop.media WHERE id = ANY($1)")
            .bind(&new.media_ids)
            .fetch_all(&mut **tx)
            .await?;
        if let Some(missing) = new.media_ids.iter().find(|id| !found.contains(id)) {
            return Err(CreateError::MediaNotFound(*missing));
        }
    }
    let id = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO conveyor_shop.listings (id, workspace_id, store_id, title, description, price_minor, currency, created_by)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(id)
    .bind(principal.workspace_id.0)
    .bind(new.store_id)
    .bind(new.title.trim())
    .bind(&new.description)
    .bind(new.price.minor())
    .bind(new.price.currency())
    .bind(principal.user_id.0)
    .execute(&mut **tx)
    .await?;
    sqlx::query(
        "INSERT INTO conveyor_shop.listing_media (listing_id, workspace_id, media_id, position)
         SELECT $1, $2, media_id, ordinality - 1 FROM unnest($3::uuid[]) WITH ORDINALITY AS m (media_id, ordinality)",
    )
    .bind(id)
    .bind(principal.workspace_id.0)
    .bind(&new.media_ids)
    .execute(&mut **tx)
    .await?;
    Ok(get_tx(tx, id).await?.expect("the listing was just written"))
}

/// A listing whose publication is now queued, and its operation.
#[derive(Clone, Debug, Serialize)]
pub struct Publication {
    /// The listing, `publishing`.
    pub listing: Listing,
    /// The `listing.publish` operation.
    pub operation: Operation,
}

/// Why a listing cannot be published.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The workspace has no such listing.
    #[error("listing not found")]
    NotFound,
    /// A publication of it is queued, running or done.
    #[error("the listing's publication {operation_id} is already queued or done; a listing is published once")]
    AlreadyPublished {
        /// That publication's operation.
        operation_id: Uuid,
    },
    /// Its store's credentials are not (or no longer) verified.
    #[error("store {store_id} is not active; verify its credentials first")]
    StoreNotActive {
        /// The store.
        store_id: Uuid,
    },
    /// One of its media is not `ready`.
    #[error("media {media_id} is not ready")]
    MediaNotReady {
        /// The first such media, in the listing's order.
        media_id: Uuid,
    },
    /// PostgreSQL failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Queues a publication of listing `id`: checks, under row locks held to the commit, that the listing has no
/// publication or only one that ended `failed`/`canceled` without a product, that the store is `active` and every
/// media `ready`; then writes the operation, its outbox event and the listing's `publishing` state (and, the first
/// time, its `publication_key`).
pub async fn publish_tx(
    tx: &mut WorkspaceTx,
    principal: &Principal,
    id: Uuid,
    trace: Option<conveyor_jobs::TraceContext>,
) -> Result<Publication, PublishError> {
    // Concurrent publishes of the listing queue up here; each later one reads the operation the first one set. An
    // operation that ended `failed` or `canceled` stays so (only a dead-letter replay revives one, and its job then
    // finds another publication on the listing and stops).
    // (The operation is read after the lock, not joined to it: a join would be re-checked against the operation row
    // read before the wait.)
    let listing: Option<(Uuid, Option<Uuid>, bool)> = sqlx::query_as(
        "SELECT store_id, publish_operation_id, marketplace_product_id IS NOT NULL FROM conveyor_shop.listings WHERE id = $1
         FOR UPDATE",
    )
    .bind(id)
    .fetch_optional(&mut **tx)
    .await?;
    let (store_id, existing, has_product) = listing.ok_or(PublishError::NotFound)?;
    if let Some(operation_id) = existing {
        let (status,): (String,) = sqlx::query_as("SELECT status FROM conveyor.operations WHERE id = $1")
            .bind(operation_id)
            .fetch_one(&mut **tx)
            .await?;
        if has_product || !matches!(status.as_str(), "failed" | "canceled") {
            return Err(PublishError::AlreadyPublished { operation_id });
        }
    }
    // FOR SHARE: a verification or new credentials cannot change the store's status before this commits.
    let (store_status,): (String,) = sqlx::query_as("SELECT status FROM conveyor_shop.stores WHERE id = $1 FOR SHARE")
        .bind(store_id)
        .fetch_one(&mut **tx)
        .await?;
    if store_status != "active" {
        return Err(PublishError::StoreNotActive { store_id });
    }
    // Locked in id order (no deadlock with another listing sharing media); the first unready one in listing order.
    let media: Vec<(Uuid, i16, String)> = sqlx::query_as(
        "SELECT m.id, lm.position, m.status FROM conveyor_shop.listing_media lm
         JOIN conveyor_shop.media m ON m.workspace_id = lm.workspace_id AND m.id = lm.media_id
         WHERE lm.listing_id = $1 ORDER BY m.id FOR SHARE OF m",
    )
    .bind(id)
    .fetch_all(&mut **tx)
    .await?;
    if let Some((media_id, _, _)) =
        media.iter().filter(|(_, _, status)| status != "ready").min_by_key(|(_, position, _)| *position)
    {
        return Err(PublishError::MediaNotReady { media_id: *media_id });
    }
    let operation =
        conveyor_jobs::create_operation_tx(tx, principal.workspace_id, principal.user_id, PUBLISH_KIND, Some(id))
            .await?;
    // The store is the marketplace's unit of quota: its publications share a limit key, so an operator's limit on it
    // (`set_key_limit`) and a rate limit the marketplace answers for it hold back this store's jobs only.
    let mut options = EnqueueOptions::new().operation(operation.id).limit_key(store_limit_key(store_id));
    if let Some(trace) = trace {
        options = options.trace(trace);
    }
    conveyor_jobs::enqueue_tx(tx, &PublishListing { listing_id: id }, options).await.map_err(|e| match e {
        EnqueueError::Database(e) => e,
        // A fixed kind with valid options and a payload of ids: none of these can happen.
        other => sqlx::Error::Protocol(other.to_string()),
    })?;
    let updated = sqlx::query(
        "UPDATE conveyor_shop.listings SET status = 'publishing', publish_operation_id = $2,
                             publication_key = coalesce(publication_key, $2), updated_at = now()
         WHERE id = $1 AND publish_operation_id IS NOT DISTINCT FROM $3",
    )
    .bind(id)
    .bind(operation.id)
    .bind(existing)
    .execute(&mut **tx)
    .await?;
    if updated.rows_affected() != 1 {
        // Cannot happen under the lock taken above; refuse rather than queue a second publication.
        return Err(sqlx::Error::Protocol("the listing's publication changed under its lock".into()).into());
    }
    let listing = get_tx(tx, id).await?.ok_or(PublishError::NotFound)?;
    Ok(Publication { listing, operation })
}

/// What a publication job did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum PublishOutcome {
    /// The marketplace made (or had made, for the listing's publication key) the product; the listing is
    /// `published`.
    Published {
        /// The marketplace's id of the product.
        marketplace_product_id: String,
    },
    /// The listing was already published by this operation: nothing was asked of the marketplace.
    AlreadyPublished {
        /// The marketplace's id of the product.
        marketplace_product_id: String,
    },
}

/// Why a publication job could not finish.
#[derive(Debug, thiserror::Error)]
pub enum PublishJobError {
    /// The marketplace failed (transient) or refused (permanent).
    #[error(transparent)]
    Marketplace(#[from] MarketplaceError),
    /// The listing no longer exists.
    #[error("the listing no longer exists")]
    ListingGone,
    /// The listing's publication is another operation than this job's.
    #[error("the listing's publication is another operation")]
    NotThisPublication,
    /// The store's sealed credentials do not open (wrong key, tampering): retrying cannot help.
    #[error("stored credentials could not be opened")]
    Unreadable,
    /// PostgreSQL failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

#[derive(sqlx::FromRow)]
struct PublishRow {
    store_id: Uuid,
    title: String,
    description: String,
    price_minor: i64,
    currency: String,
    publish_operation_id: Option<Uuid>,
    publication_key: Option<Uuid>,
    marketplace_product_id: Option<String>,
    media_ids: Vec<Uuid>,
    nonce: Vec<u8>,
    ciphertext: Vec<u8>,
}

/// Creates listing `listing_id`'s product on its store's marketplace and records it `published`, in the job's
/// transaction, if `operation_id` is the listing's current publication. The listing's `publication_key` (its first
/// publication's operation id) is the marketplace's idempotency key, whichever publication runs: a repeat, or a later
/// publication after one canceled mid-call, makes no second product and records the first one.
pub async fn publish_to_marketplace_tx(
    tx: &mut WorkspaceTx,
    sealer: &Sealer,
    marketplace: &dyn Marketplace,
    workspace_id: Uuid,
    listing_id: Uuid,
    operation_id: Option<Uuid>,
) -> Result<PublishOutcome, PublishJobError> {
    let row = sqlx::query_as::<_, PublishRow>(
        "SELECT l.store_id, l.title, l.description, l.price_minor, l.currency, l.publish_operation_id,
                l.publication_key, l.marketplace_product_id,
                ARRAY(SELECT m.media_id FROM conveyor_shop.listing_media m WHERE m.listing_id = l.id ORDER BY m.position)
                    AS media_ids,
                c.nonce, c.ciphertext
         FROM conveyor_shop.listings l JOIN conveyor_shop.store_credentials c ON c.store_id = l.store_id
         WHERE l.id = $1",
    )
    .bind(listing_id)
    .fetch_optional(&mut **tx)
    .await?
    .ok_or(PublishJobError::ListingGone)?;
    if operation_id.is_none() || row.publish_operation_id != operation_id {
        return Err(PublishJobError::NotThisPublication);
    }
    if let Some(marketplace_product_id) = row.marketplace_product_id {
        return Ok(PublishOutcome::AlreadyPublished { marketplace_product_id });
    }
    let key = row.publication_key.ok_or(PublishJobError::NotThisPublication)?.to_string();
    let plain = sealer
        .open(&row.nonce, &row.ciphertext, &credentials_aad(workspace_id, row.store_id))
        .map_err(|_| PublishJobError::Unreadable)?;
    let credentials = Credentials::from_json(&plain).map_err(|_| PublishJobError::Unreadable)?;
    let price = Price::from_stored(row.price_minor, row.currency);
    let product = NewProduct {
        title: row.title,
        description: row.description,
        price_amount: price.amount(),
        currency: price.currency,
        media_ids: row.media_ids,
    };
    let created = marketplace.create_product(&key, credentials.fields(), &product).await?;
    let recorded = sqlx::query(
        "UPDATE conveyor_shop.listings SET status = 'published', marketplace_product_id = $3, published_at = now(), updated_at = now()
         WHERE id = $1 AND publish_operation_id = $2 AND marketplace_product_id IS NULL",
    )
    .bind(listing_id)
    .bind(operation_id)
    .bind(&created.id)
    .execute(&mut **tx)
    .await?;
    if recorded.rows_affected() != 1 {
        return Err(PublishJobError::NotThisPublication);
    }
    Ok(PublishOutcome::Published { marketplace_product_id: created.id })
}

/// The limit key of a store's marketplace calls (`store:<id>`).
fn store_limit_key(store_id: Uuid) -> String {
    format!("store:{store_id}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_currency_table_is_sorted_for_its_binary_search() {
        assert!(CURRENCIES.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(minor_unit_digits("EUR"), Some(2));
        assert_eq!(minor_unit_digits("JPY"), Some(0));
        assert_eq!(minor_unit_digits("eur"), None);
        assert_eq!(minor_unit_digits("XAU"), None);
    }

    #[test]
    fn prices_are_exact_minor_units_and_print_with_the_currencys_digits() {
        let cases = [
            ("12.50", "EUR", 1250, "12.50"),
            ("12.5", "EUR", 1250, "12.50"),
            ("12", "USD", 1200, "12.00"),
            ("0.01", "GBP", 1, "0.01"),
            ("999999999.99", "EUR", 99_999_999_999, "999999999.99"),
            ("1200", "JPY", 1200, "1200"),
            ("1.25", "BHD", 1250, "1.250"),
        ];
        for (amount, currency, minor, printed) in cases {
            let price = Price::parse(amount, currency).unwrap();
            assert_eq!((price.minor(), price.amount().as_str()), (minor, printed), "{amount} {currency}");
        }
    }

    #[test]
    fn malformed_zero_negative_and_too_precise_amounts_are_refused() {
        for amount in
            ["0", "0.00", "-1", "+1", "12.505", "12.", ".5", "1e3", "12,50", " 12", "12 ", "", "1000000000", "1.2.3"]
        {
            assert!(Price::parse(amount, "EUR").is_err(), "{amount:?}");
        }
        assert!(Price::parse("12.50", "JPY").is_err(), "JPY has no minor unit");
        assert!(Price::parse("1.255", "BHD").is_err(), "two decimals at most");
        for currency in ["eur", "EU", "EURO", "XXX", "XAU", ""] {
            assert!(Price::parse("1", currency).is_err(), "{currency:?}");
        }
    }

    #[test]
    fn titles_descriptions_and_media_lists_are_bounded() {
        let valid = NewListing {
            store_id: Uuid::now_v7(),
            title: "Mug".into(),
            description: String::new(),
            price: Price::parse("1", "EUR").unwrap(),
            media_ids: vec![],
        };
        assert!(valid.validate().is_ok());
        let title = |t: &str| NewListing { title: t.into(), ..valid.clone() }.validate();
        assert!(title("  ").is_err());
        assert!(title(&"é".repeat(200)).is_ok());
        assert!(title(&"é".repeat(201)).is_err());
        let description = NewListing { description: "x".repeat(10_001), ..valid.clone() };
        assert!(description.validate().is_err());
        let many = NewListing { media_ids: (0..21).map(|_| Uuid::now_v7()).collect(), ..valid.clone() };
        assert!(many.validate().is_err());
        let id = Uuid::now_v7();
        assert!(NewListing { media_ids: vec![id, id], ..valid }.validate().is_err());
    }
}
