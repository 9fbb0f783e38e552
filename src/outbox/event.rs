//! What an outbox event carries: one serde-tagged enum of job payloads, ids only (seed section 3).

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The queues (one Redis stream each) and which job types go to them.
pub mod queues {
    /// Store authorization work: credential verification.
    pub const STORES: &str = "stores";
}

/// A job's payload. Never carries credentials, cookies, pre-signed URLs or personal data: the worker reads what it
/// needs inside a workspace-scoped transaction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", content = "payload", deny_unknown_fields)]
pub enum JobPayload {
    /// Verify a store's current credentials against its marketplace.
    #[serde(rename = "store.verify_credentials")]
    StoreVerifyCredentials {
        /// The store.
        store_id: Uuid,
        /// The credentials version to verify; a newer one supersedes this job.
        credentials_version: i32,
    },
}

impl JobPayload {
    /// The event type, as stored in `outbox_events.event_type` and the stream's `type` field.
    pub fn event_type(&self) -> &'static str {
        match self {
            Self::StoreVerifyCredentials { .. } => "store.verify_credentials",
        }
    }

    /// The queue this job goes to.
    pub fn queue(&self) -> &'static str {
        match self {
            Self::StoreVerifyCredentials { .. } => queues::STORES,
        }
    }

    /// The queue that carries jobs of `event_type`, if it is a known type.
    pub fn queue_of(event_type: &str) -> Option<&'static str> {
        match event_type {
            "store.verify_credentials" => Some(queues::STORES),
            _ => None,
        }
    }

    /// The payload alone (without its type), as stored in `outbox_events.event_payload`.
    pub fn body(&self) -> serde_json::Value {
        match serde_json::to_value(self).expect("job payloads serialize") {
            serde_json::Value::Object(mut map) => map.remove("payload").unwrap_or_default(),
            _ => unreachable!("adjacently tagged enums serialize to objects"),
        }
    }

    /// Rebuilds a payload from its type and body; fails on an unknown type or a malformed body.
    pub fn decode(event_type: &str, body: &str) -> Result<Self, serde_json::Error> {
        let body: serde_json::Value = serde_json::from_str(body)?;
        serde_json::from_value(serde_json::json!({ "type": event_type, "payload": body }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_round_trips_through_type_and_body() {
        let p = JobPayload::StoreVerifyCredentials { store_id: Uuid::now_v7(), credentials_version: 3 };
        let body = p.body().to_string();
        assert_eq!(JobPayload::decode(p.event_type(), &body).unwrap(), p);
    }

    #[test]
    fn every_type_names_its_queue() {
        let p = JobPayload::StoreVerifyCredentials { store_id: Uuid::now_v7(), credentials_version: 1 };
        assert_eq!(JobPayload::queue_of(p.event_type()), Some(p.queue()));
        assert_eq!(JobPayload::queue_of("nope"), None);
    }

    #[test]
    fn an_unknown_type_or_malformed_body_does_not_decode() {
        assert!(JobPayload::decode("store.nope", r#"{"store_id":"x"}"#).is_err());
        assert!(JobPayload::decode("store.verify_credentials", "{not json").is_err());
        assert!(
            JobPayload::decode("store.verify_credentials", r#"{"store_id":"not-a-uuid","credentials_version":1}"#)
                .is_err()
        );
    }
}
