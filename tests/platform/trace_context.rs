//! A job's W3C trace context travels whole: the `traceparent` and the `tracestate` that came with it, from the
//! enqueue through the outbox row and the stream entry to the handler, which can pass both on.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use conveyor_jobs::{Conveyor, EnqueueError, EnqueueOptions, Handler, JobContext, JobError, JobKind, TraceContext};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::kit::{self, Platform};

#[derive(Serialize, Deserialize)]
struct Traced {
    n: u32,
}

impl JobKind for Traced {
    const KIND: &'static str = "test.traced";
    const QUEUE: &'static str = "test-traced";
}

/// Records the trace context each run saw, by the job's `n`.
struct Seen(Arc<Mutex<Vec<(u32, TraceContext)>>>);

impl Handler<Traced> for Seen {
    async fn handle(&self, job: Traced, cx: &mut JobContext) -> Result<Value, JobError> {
        self.0.lock().unwrap().push((job.n, cx.trace()));
        Ok(Value::Null)
    }
}

const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const STATE: &str = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7";

#[tokio::test]
async fn the_tracestate_reaches_the_handler_beside_its_traceparent() {
    let platform = Platform::single_role().await;
    let conveyor =
        Conveyor::builder(platform.pool.clone(), &kit::redis_url()).prefix(&platform.prefix).connect().await.unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let worker = conveyor.worker().handle::<Traced>(Seen(seen.clone())).build().unwrap();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(conveyor.clone().run(worker, shutdown.clone()));

    let with_state = TraceContext { traceparent: PARENT.to_owned(), tracestate: Some(STATE.to_owned()) };
    let a = conveyor.enqueue(&Traced { n: 1 }, EnqueueOptions::new().trace(with_state.clone())).await.unwrap();
    let b = conveyor.enqueue(&Traced { n: 2 }, EnqueueOptions::new().traceparent(PARENT)).await.unwrap();
    for job in [a.id, b.id] {
        conveyor.wait_for_job(job, Duration::from_secs(30)).await.unwrap();
    }
    let mut seen = seen.lock().unwrap().clone();
    seen.sort_by_key(|(n, _)| *n);
    // With traces not exported, the context travels as it came.
    assert_eq!(seen[0], (1, with_state));
    assert_eq!(seen[1], (2, TraceContext { traceparent: PARENT.to_owned(), tracestate: None }));
    shutdown.cancel();
    running.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_tracestate_without_its_traceparent_or_that_cannot_travel_is_refused() {
    let platform = Platform::single_role().await;
    let conveyor =
        Conveyor::builder(platform.pool.clone(), &kit::redis_url()).prefix(&platform.prefix).connect().await.unwrap();
    for (options, why) in [
        (EnqueueOptions::new().tracestate(STATE), "tracestate needs the traceparent"),
        (EnqueueOptions::new().traceparent(PARENT).tracestate("a=b\nc=d"), "printable ASCII"),
        (EnqueueOptions::new().traceparent(PARENT).tracestate("a".repeat(513)), "1 to 512"),
        (EnqueueOptions::new().traceparent(format!("{PARENT}\na=b")), "on one line"),
    ] {
        match conveyor.enqueue(&Traced { n: 0 }, options).await {
            Err(EnqueueError::InvalidOptions(message)) => assert!(message.contains(why), "{message}"),
            other => panic!("{why}: {other:?}"),
        }
    }
    let jobs: i64 =
        sqlx::query_scalar("SELECT count(*) FROM conveyor.outbox_events").fetch_one(&platform.pool).await.unwrap();
    assert_eq!(jobs, 0, "nothing was enqueued");
}
