//! The error of the platform's long-running parts and their set-up: the dispatcher, the worker, maintenance and the
//! migrations. Its kind says where it failed, [`Error::is_unavailable`] whether PostgreSQL or Redis could not be
//! reached (worth retrying) rather than refusing. Its message is the outermost context; [`std::error::Error::source`]
//! walks the rest (anyhow's `{:#}` prints them all).

use std::fmt;

/// Where an [`Error`] comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// PostgreSQL refused a statement or could not be reached.
    Postgres,
    /// Redis refused a command or could not be reached.
    Redis,
    /// A setting, URL or argument the component cannot run with, found before it ran.
    Invalid,
    /// Anything else: the message says what.
    Other,
}

/// Why a call of the dispatcher, the worker, maintenance or the migrations failed.
pub struct Error {
    kind: ErrorKind,
    unavailable: bool,
    inner: anyhow::Error,
}

impl Error {
    /// Classifies `inner` by the first PostgreSQL or Redis error in its chain.
    pub(crate) fn new(inner: anyhow::Error) -> Self {
        let mut kind = ErrorKind::Other;
        let mut unavailable = false;
        for cause in inner.chain() {
            if let Some(e) = cause.downcast_ref::<sqlx::Error>() {
                (kind, unavailable) = match e {
                    sqlx::Error::Configuration(_) => (ErrorKind::Invalid, false),
                    e => (ErrorKind::Postgres, crate::db::is_unavailable(e)),
                };
                break;
            }
            if let Some(e) = cause.downcast_ref::<fred::error::Error>() {
                (kind, unavailable) = match e.kind() {
                    fred::error::ErrorKind::Config | fred::error::ErrorKind::Url => (ErrorKind::Invalid, false),
                    _ => (ErrorKind::Redis, crate::stream::is_unavailable(e)),
                };
                break;
            }
            if let Some(e) = cause.downcast_ref::<crate::RedisError>() {
                (kind, unavailable) = (ErrorKind::Redis, e.is_unavailable());
                break;
            }
            if cause.downcast_ref::<crate::SettingsError>().is_some() {
                kind = ErrorKind::Invalid;
                break;
            }
        }
        Self { kind, unavailable, inner }
    }

    /// A setting or argument refused before anything ran.
    pub(crate) fn invalid(inner: anyhow::Error) -> Self {
        Self { kind: ErrorKind::Invalid, unavailable: false, inner }
    }

    /// Where it comes from.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// Whether PostgreSQL or Redis could not be reached (a lost connection, a time-out), as opposed to refusing.
    pub fn is_unavailable(&self) -> bool {
        self.unavailable
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `{:#}` prints the whole chain, as anyhow's does; `{}` the outermost context.
        if f.alternate() { write!(f, "{:#}", self.inner) } else { write!(f, "{}", self.inner) }
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} ({:?})", self.inner, self.kind)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.inner.source()
    }
}

/// `anyhow::Result` to the platform's [`Error`] at the public boundary.
pub(crate) trait Public<T> {
    /// The result, its error classified.
    fn public(self) -> Result<T, Error>;
}

impl<T> Public<T> for anyhow::Result<T> {
    fn public(self) -> Result<T, Error> {
        self.map_err(Error::new)
    }
}

#[cfg(test)]
mod tests {
    use anyhow::Context;

    use super::*;

    #[test]
    fn an_error_is_classified_by_the_first_database_redis_or_settings_error_in_its_chain() {
        let lost: anyhow::Result<()> = Err(sqlx::Error::PoolTimedOut).context("Failed to claim");
        let e = lost.public().unwrap_err();
        assert_eq!((e.kind(), e.is_unavailable()), (ErrorKind::Postgres, true));
        assert_eq!(e.to_string(), "Failed to claim", "the message is the outermost context");
        assert_eq!(format!("{e:#}"), "Failed to claim: pool timed out while waiting for an open connection");
        let source = std::error::Error::source(&e).expect("the cause is the source");
        assert!(source.to_string().contains("pool timed out"), "{source}");

        let refused: anyhow::Result<()> = Err(sqlx::Error::RowNotFound.into());
        let e = refused.public().unwrap_err();
        assert_eq!((e.kind(), e.is_unavailable()), (ErrorKind::Postgres, false));

        let io = fred::error::Error::new(fred::error::ErrorKind::IO, "connection reset");
        let e = Err::<(), _>(anyhow::Error::new(io)).context("XADD").public().unwrap_err();
        assert_eq!((e.kind(), e.is_unavailable()), (ErrorKind::Redis, true));
        let reset = crate::RedisError::fred(fred::error::Error::new(fred::error::ErrorKind::IO, "reset"));
        let e = Err::<(), _>(anyhow::Error::new(reset)).context("XREADGROUP").public().unwrap_err();
        assert_eq!((e.kind(), e.is_unavailable()), (ErrorKind::Redis, true));
        let wrong = fred::error::Error::new(fred::error::ErrorKind::Unknown, "WRONGTYPE");
        let e = Err::<(), _>(anyhow::Error::new(wrong)).public().unwrap_err();
        assert_eq!((e.kind(), e.is_unavailable()), (ErrorKind::Redis, false));

        let bad_url: anyhow::Result<()> = Err(sqlx::Error::Configuration("no host".into())).context("DATABASE_URL");
        assert_eq!(bad_url.public().unwrap_err().kind(), ErrorKind::Invalid);
        let bad_redis = fred::error::Error::new(fred::error::ErrorKind::Config, "rediss:// without TLS");
        assert_eq!(Err::<(), _>(anyhow::Error::new(bad_redis)).public().unwrap_err().kind(), ErrorKind::Invalid);
        let setting = Err::<(), _>(anyhow::Error::new(crate::SettingsError::new("concurrency", "must be at least 1")));
        assert_eq!(setting.public().unwrap_err().kind(), ErrorKind::Invalid);
        assert_eq!(Err::<(), _>(anyhow::anyhow!("a task ended")).public().unwrap_err().kind(), ErrorKind::Other);
    }
}
