//! Typed identifiers: a workspace id can never be passed where a user id is expected.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub Uuid);

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.0.fmt(f)
            }
        }

        impl From<Uuid> for $name {
            fn from(id: Uuid) -> Self {
                Self(id)
            }
        }
    };
}

id_type!(
    /// A tenant. Every tenant row carries one and row-level security compares it with `app.workspace_id`.
    WorkspaceId
);
id_type!(
    /// An authenticated user (the JWT `sub`).
    UserId
);
id_type!(
    /// A job: the id of its outbox event (a UUIDv7), which is also its id in the queue.
    JobId
);

impl WorkspaceId {
    /// The workspace of a service that has no tenants (the nil UUID): [`begin`](crate::begin) and a
    /// [`Conveyor`](crate::Conveyor) without a workspace of its own use it, so that a single-tenant service never names
    /// one.
    pub const DEFAULT: Self = Self(Uuid::nil());
}

/// This process's name among its peers: host, process id and a random suffix. Dispatchers hold leases under it
/// (`locked_by`) and workers consume under it, so it must differ between processes, restarts included.
pub fn instance_name() -> String {
    let host = std::env::var("HOSTNAME").or_else(|_| std::fs::read_to_string("/etc/hostname")).unwrap_or_default();
    format!("{}-{}-{}", host.trim(), std::process::id(), &Uuid::new_v4().simple().to_string()[..8])
}
