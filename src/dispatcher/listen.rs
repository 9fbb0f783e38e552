//! The dispatcher's `LISTEN`, kept up through PostgreSQL restarts and connection resets. A notification lost with its
//! connection is never delivered again, so every time the listener (re)opens, it asks for a sweep: whatever was
//! committed while nobody listened is found by it. Reconnection backs off while PostgreSQL is down, never longer than
//! [`RETRY_MAX`] between tries, whatever the poll interval.

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::Wake;
use crate::redact::redact;

/// The first wait before opening the listener again.
const RETRY_MIN: Duration = Duration::from_millis(100);

/// The longest wait between tries to open the listener.
const RETRY_MAX: Duration = Duration::from_secs(2);

/// Listens on `channels` through a connection of `pool` until `stop`, forwarding what each notification asks for to
/// `wake`, and a sweep each time the listener (re)opens; reopens it whenever its connection fails. Ends early when
/// nobody receives any more.
pub(super) async fn listen(
    pool: PgPool,
    channels: Vec<&'static str>,
    wake: mpsc::UnboundedSender<Wake>,
    stop: CancellationToken,
) {
    let mut retry = RETRY_MIN;
    // Set once a listener was lost, until one is open again (for the log).
    let mut lost: Option<std::time::Instant> = None;
    loop {
        let opening = async {
            let mut listener = PgListener::connect_with(&pool).await?;
            // A lost connection ends this listener; the next one is opened here, with a sweep after it.
            listener.eager_reconnect(false);
            listener.listen_all(channels.iter().copied()).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        let opened = tokio::select! {
            _ = stop.cancelled() => return,
            opened = opening => opened,
        };
        let mut listener = match opened {
            Ok(listener) => listener,
            Err(e) => {
                if retry == RETRY_MIN {
                    let error = redact(&e.to_string());
                    tracing::warn!(%error, "Cannot LISTEN; retrying, sweeping every poll meanwhile");
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(retry) => {}
                }
                retry = (retry * 2).min(RETRY_MAX);
                continue;
            }
        };
        retry = RETRY_MIN;
        match lost.take() {
            Some(since) => tracing::info!(
                down_ms = since.elapsed().as_millis() as u64,
                "LISTEN re-established; sweeping for what was missed"
            ),
            None => tracing::debug!(?channels, "Listening"),
        }
        if wake.send(Wake::default()).is_err() {
            return;
        }
        loop {
            let next = tokio::select! {
                _ = stop.cancelled() => return,
                next = listener.try_recv() => next,
            };
            match next {
                Ok(Some(notification)) => {
                    if wake.send(Wake::parse(notification.payload())).is_err() {
                        return;
                    }
                }
                Ok(None) => {
                    tracing::warn!("LISTEN connection lost; listening again");
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %redact(&e.to_string()), "LISTEN connection failed; listening again");
                    break;
                }
            }
        }
        lost = Some(std::time::Instant::now());
    }
}
