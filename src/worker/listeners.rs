//! Which workspaces have a subscription to job events open ([`crate::subscribe_events`]): there the worker writes an
//! `active` event as a handler starts (where one wants it), and announces progress. Looked up at most once a second,
//! as jobs start; nothing is looked up while no job starts.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
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

pub(super) struct Listeners(Arc<Shared>);

struct Shared {
    /// The runtime role's: the look-up works across workspaces (`conveyor_event_listened_workspaces`, ids only).
    runtime: PgPool,
    heard: Mutex<Arc<Heard>>,
    /// Held through the first look-up, which the first jobs wait for; later ones run in a task of their own.
    first: tokio::sync::Mutex<()>,
    /// A later look-up is under way.
    looking: AtomicBool,
}

impl Shared {
    fn heard(&self) -> Arc<Heard> {
        self.heard.lock().expect("listeners lock").clone()
    }

    async fn look_up(&self) {
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
}

impl Listeners {
    pub(super) fn new(runtime: PgPool) -> Self {
        Self(Arc::new(Shared {
            runtime,
            heard: Mutex::new(Arc::default()),
            first: tokio::sync::Mutex::new(()),
            looking: AtomicBool::new(false),
        }))
    }

    /// What the subscriptions of `workspace` ask of a job starting now. The worker's first jobs wait for the first
    /// look-up; after that a job never waits for one: a stale view is refreshed in the background.
    pub(super) async fn of(&self, workspace: WorkspaceId) -> Listening {
        let heard = self.0.heard();
        match heard.at {
            None => {
                let _first = self.0.first.lock().await;
                if self.0.heard().at.is_none() {
                    self.0.look_up().await;
                }
            }
            Some(at) if at.elapsed() >= FRESH_FOR && !self.0.looking.swap(true, Ordering::AcqRel) => {
                let shared = self.0.clone();
                tokio::spawn(async move {
                    shared.look_up().await;
                    shared.looking.store(false, Ordering::Release);
                });
            }
            Some(_) => {}
        }
        match self.0.heard().workspaces.get(&workspace.0) {
            Some(&active) => Listening { announce: true, active },
            None => Listening::default(),
        }
    }
}
