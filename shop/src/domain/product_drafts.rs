//! Product drafts: edited by people, no background work. Lost updates are prevented by a revision (the HTTP `ETag`):
//! a write names the revision it read, and the check and the write are one conditional `UPDATE`, so of concurrent
//! writers holding the same revision exactly one wins and the others learn the current revision.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::ValidationError;
use crate::Principal;
use conveyor_jobs::WorkspaceTx;

/// Longest title, in characters.
pub const MAX_TITLE_CHARS: usize = 200;
/// Longest description, in characters.
pub const MAX_DESCRIPTION_CHARS: usize = 20_000;
/// Most attributes of one draft.
pub const MAX_ATTRIBUTES: usize = 100;
/// Longest attribute name, in characters.
pub const MAX_ATTRIBUTE_NAME_CHARS: usize = 100;

/// A draft as clients see it.
#[derive(Clone, Debug, Serialize, sqlx::FromRow)]
pub struct ProductDraft {
    /// Id.
    pub id: Uuid,
    /// Title.
    pub title: String,
    /// Description.
    pub description: String,
    /// Free-form attributes (an object).
    pub attributes: serde_json::Value,
    /// Starts at 1, one more with every write; the `ETag`.
    pub revision: i64,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
}

macro_rules! columns {
    () => {
        "id, title, description, attributes, revision, created_at, updated_at"
    };
}

/// The editable content of a draft: what `POST` creates and `PUT` replaces.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DraftContent {
    /// 1 to 200 characters.
    pub title: String,
    /// Up to 20,000 characters (default empty).
    #[serde(default)]
    pub description: String,
    /// An object of at most 100 members (default empty).
    #[serde(default = "empty_object")]
    pub attributes: serde_json::Value,
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(serde_json::Map::new())
}

impl DraftContent {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), ValidationError> {
        let title = self.title.trim();
        if title.is_empty() || title.chars().count() > MAX_TITLE_CHARS {
            return Err(ValidationError(format!("title must be 1 to {MAX_TITLE_CHARS} characters")));
        }
        if self.description.chars().count() > MAX_DESCRIPTION_CHARS {
            return Err(ValidationError(format!("description must be at most {MAX_DESCRIPTION_CHARS} characters")));
        }
        let Some(attributes) = self.attributes.as_object() else {
            return Err(ValidationError("attributes must be an object".into()));
        };
        if attributes.len() > MAX_ATTRIBUTES {
            return Err(ValidationError(format!("attributes must have at most {MAX_ATTRIBUTES} members")));
        }
        if attributes.keys().any(|k| k.is_empty() || k.chars().count() > MAX_ATTRIBUTE_NAME_CHARS) {
            return Err(ValidationError(format!("attribute names must be 1 to {MAX_ATTRIBUTE_NAME_CHARS} characters")));
        }
        Ok(())
    }
}

/// Creates a draft at revision 1.
pub async fn create_tx(
    tx: &mut WorkspaceTx,
    principal: &Principal,
    content: &DraftContent,
) -> Result<ProductDraft, sqlx::Error> {
    sqlx::query_as::<_, ProductDraft>(concat!(
        "INSERT INTO conveyor_shop.product_drafts (id, workspace_id, title, description, attributes, created_by, updated_by)
         VALUES ($1, $2, $3, $4, $5, $6, $6) RETURNING ",
        columns!()
    ))
    .bind(Uuid::now_v7())
    .bind(principal.workspace_id.0)
    .bind(content.title.trim())
    .bind(&content.description)
    .bind(&content.attributes)
    .bind(principal.user_id.0)
    .fetch_one(&mut **tx)
    .await
}

/// The draft `id` of the transaction's workspace, if any.
pub async fn get_tx(tx: &mut WorkspaceTx, id: Uuid) -> Result<Option<ProductDraft>, sqlx::Error> {
    sqlx::query_as::<_, ProductDraft>(concat!(
        "SELECT ",
        columns!(),
        " FROM conveyor_shop.product_drafts WHERE id = $1"
    ))
    .bind(id)
    .fetch_optional(&mut **tx)
    .await
}

/// What a conditional replace did.
#[derive(Debug)]
pub enum Replace {
    /// Written: the draft at its new revision.
    Replaced(ProductDraft),
    /// Someone wrote first: the draft's current revision (nothing written).
    Stale {
        /// The revision now.
        current_revision: i64,
    },
    /// No such draft in the workspace.
    NotFound,
}

/// Replaces the content of draft `id` if its revision is one of `expected`, in one conditional statement.
pub async fn replace_tx(
    tx: &mut WorkspaceTx,
    principal: &Principal,
    id: Uuid,
    expected: &[i64],
    content: &DraftContent,
) -> Result<Replace, sqlx::Error> {
    let replaced = sqlx::query_as::<_, ProductDraft>(concat!(
        "UPDATE conveyor_shop.product_drafts
         SET title = $3, description = $4, attributes = $5, updated_by = $6, revision = revision + 1,
             updated_at = now()
         WHERE id = $1 AND revision = ANY($2) RETURNING ",
        columns!()
    ))
    .bind(id)
    .bind(expected)
    .bind(content.title.trim())
    .bind(&content.description)
    .bind(&content.attributes)
    .bind(principal.user_id.0)
    .fetch_optional(&mut **tx)
    .await?;
    if let Some(draft) = replaced {
        return Ok(Replace::Replaced(draft));
    }
    // Not written: tell why. The revision read here is at least as new as the one that made the UPDATE miss.
    let current: Option<(i64,)> = sqlx::query_as("SELECT revision FROM conveyor_shop.product_drafts WHERE id = $1")
        .bind(id)
        .fetch_optional(&mut **tx)
        .await?;
    Ok(match current {
        Some((current_revision,)) => Replace::Stale { current_revision },
        None => Replace::NotFound,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn content(value: serde_json::Value) -> Result<DraftContent, serde_json::Error> {
        serde_json::from_value(value)
    }

    #[test]
    fn content_is_checked_field_by_field() {
        assert!(content(serde_json::json!({"title": "Mug"})).unwrap().validate().is_ok());
        assert!(content(serde_json::json!({"title": "Mug", "colour": "red"})).is_err(), "unknown field");
        assert!(content(serde_json::json!({"title": 3})).is_err(), "wrong type");
        for bad in [
            serde_json::json!({"title": "  "}),
            serde_json::json!({"title": "x".repeat(MAX_TITLE_CHARS + 1)}),
            serde_json::json!({"title": "Mug", "description": "d".repeat(MAX_DESCRIPTION_CHARS + 1)}),
            serde_json::json!({"title": "Mug", "attributes": []}),
            serde_json::json!({"title": "Mug", "attributes": {"": 1}}),
        ] {
            assert!(content(bad.clone()).unwrap().validate().is_err(), "{bad}");
        }
        let many: serde_json::Map<String, serde_json::Value> =
            (0..=MAX_ATTRIBUTES).map(|i| (format!("a{i}"), serde_json::Value::Null)).collect();
        let too_many = content(serde_json::json!({"title": "Mug", "attributes": many})).unwrap();
        assert!(too_many.validate().is_err());
    }
}
