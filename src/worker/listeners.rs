//! Which workspaces have a subscription to job events open ([`crate::subscribe_events`]): there the worker writes an
//! `active` event as a handler starts (where one wants it), and announces progress. Looked up at most once a second,
//! as jobs start; nothing is looked up while no job starts.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use uuid::Uuid;

use crate::ids::WorkspaceId;
use crate::redact::redact;

/// How old the worker's view of the subscriptions may be: a new subscription hears the starts of jobs that start
/// this long after it at the latest.
const FRESH_FOR: Duration = Duration::from_secs(1);

/// What the subscriptions open in a workspace ask of a starting job.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Listening {
    /// Announce its events (`NOTIFY`): some subscription reads them.
    pub(crate) announce: bool,
    /// Write its start, an `active` event.
    pub(crate) active: bool,
}

/// The subscriptions as last looked up: by workspace, whether one wants `active` events.
#[derive(Default)]
struct Heard {
    at: Option<Instant>,
    workspaces: HashMap<Uuid, bool>,
}

pub(super) struct Listeners {
    /// The runtime role's: the look-up works across workspaces (`conveyor_event_listened_workspaces`, ids only).
    runtime: PgPool,
    heard: Mutex<Arc<Heard>>,
    /// Held by the one job that looks up, while the others go by the view they have.
    looking: tokio::sync::Mutex<()>,
}

impl Listeners {
    pub(super) fn new(runtime: PgPool) -> Self {
        Self { runtime, heard: Mutex::new(Arc::default()), looking: tokio::sync::Mutex::new(()) }
    }

    fn heard(&self) -> Arc<Heard> {
        self.heard.lock().expect("listeners lock").clone()
    }

    /// What the subscriptions of `workspace` ask of a job starting now.
    pub(super) async fn of(&self, workspace: WorkspaceId) -> Listening {
        let stale = |h: &Heard| h.at.is_none_or(|at| at.elapsed() >= FRESH_FOR);
        if stale(&self.heard())
            && let Ok(_looking) = self.looking.try_lock()
            && stale(&self.heard())
        {
            let rows: Result<Vec<(Uuid, bool)>, sqlx::Error> =
                sqlx::query_as("SELECT workspace_id, active FROM conveyor.conveyor_event_listened_workspaces()")
                    .fetch_all(&self.runtime)
                    .await;
            let workspaces = match rows {
                Ok(rows) => rows.into_iter().collect(),
                Err(e) => {
                    tracing::warn!(error = %redact(&e.to_string()), "Cannot look up event subscriptions; going by the last look");
                    self.heard().workspaces.clone()
                }
            };
            *self.heard.lock().expect("listeners lock") = Arc::new(Heard { at: Some(Instant::now()), workspaces });
        }
        match self.heard().workspaces.get(&workspace.0) {
            Some(&active) => Listening { announce: true, active },
            None => Listening::default(),
        }
    }
}
