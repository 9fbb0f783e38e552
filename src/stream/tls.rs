//! TLS to Redis (`rediss://`, `rediss-cluster://`, `rediss-sentinel://`) over rustls with ring, the tree's one TLS
//! stack. The server is verified against a CA file of the operator's when one is named (that CA alone, as
//! PostgreSQL's `sslrootcert` does), else against the system's roots; a client certificate may be presented. A URL
//! that asks for TLS never falls back to plain text, and a plain URL never speaks TLS.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use fred::types::config::{TlsConfig, TlsHostMapping};
use rustls::ClientConfig;
use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// The files of a TLS connection to Redis (`CONVEYOR_REDIS_CA_FILE`, `CONVEYOR_REDIS_CLIENT_CERT_FILE`,
/// `CONVEYOR_REDIS_CLIENT_KEY_FILE`); all optional. [`RedisTls::default`] verifies against the system's roots.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RedisTls {
    /// PEM file of the CA certificates to trust instead of the system's roots.
    pub ca_file: Option<PathBuf>,
    /// PEM file of the client certificate chain to present (with [`RedisTls::client_key_file`]).
    pub client_cert_file: Option<PathBuf>,
    /// PEM file of the client certificate's private key.
    pub client_key_file: Option<PathBuf>,
}

/// Why a TLS configuration could not be built; names the variable of the file at fault.
#[derive(Debug, thiserror::Error)]
#[error("{variable}: {reason}")]
pub struct TlsFileError {
    /// The variable naming the file.
    pub variable: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

fn file_error(variable: &'static str, path: &Path, reason: impl std::fmt::Display) -> TlsFileError {
    TlsFileError { variable, reason: format!("{}: {reason}", path.display()) }
}

/// Whether a Redis URL asks for TLS.
pub fn url_uses_tls(url: &str) -> bool {
    url.split_once("://").is_some_and(|(scheme, _)| {
        matches!(scheme, "rediss" | "rediss-cluster" | "rediss-sentinel" | "valkeys" | "valkeys-cluster")
    })
}

impl RedisTls {
    /// Whether any file is named.
    pub fn is_set(&self) -> bool {
        self.ca_file.is_some() || self.client_cert_file.is_some() || self.client_key_file.is_some()
    }

    /// Reads the files and checks that they make a TLS configuration (what [`crate::connect_redis_with`] would
    /// build), without connecting: the error names the variable of the file at fault.
    pub fn check(&self) -> Result<(), TlsFileError> {
        self.fred_config().map(drop)
    }

    /// Reads the files and builds fred's TLS configuration: `None` when no file is named (fred then verifies against
    /// the system's roots).
    pub(crate) fn fred_config(&self) -> Result<Option<TlsConfig>, TlsFileError> {
        if !self.is_set() {
            return Ok(None);
        }
        let roots = match &self.ca_file {
            Some(path) => {
                let mut roots = RootCertStore::empty();
                for cert in certificates("CONVEYOR_REDIS_CA_FILE", path)? {
                    roots.add(cert).map_err(|e| file_error("CONVEYOR_REDIS_CA_FILE", path, e))?;
                }
                roots
            }
            None => {
                let mut roots = RootCertStore::empty();
                for cert in rustls_native_certs::load_native_certs().certs {
                    let _ = roots.add(cert);
                }
                roots
            }
        };
        let builder = ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsFileError { variable: "CONVEYOR_REDIS_URL", reason: e.to_string() })?
            .with_root_certificates(roots);
        let config = match (&self.client_cert_file, &self.client_key_file) {
            (None, None) => builder.with_no_client_auth(),
            (Some(cert), Some(key)) => {
                let chain = certificates("CONVEYOR_REDIS_CLIENT_CERT_FILE", cert)?;
                let key = PrivateKeyDer::from_pem_file(key).map_err(|e| {
                    file_error("CONVEYOR_REDIS_CLIENT_KEY_FILE", key, format!("no private key read: {e}"))
                })?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| file_error("CONVEYOR_REDIS_CLIENT_KEY_FILE", cert, e))?
            }
            (Some(_), None) => {
                return Err(TlsFileError {
                    variable: "CONVEYOR_REDIS_CLIENT_KEY_FILE",
                    reason: "is required with CONVEYOR_REDIS_CLIENT_CERT_FILE".to_owned(),
                });
            }
            (None, Some(_)) => {
                return Err(TlsFileError {
                    variable: "CONVEYOR_REDIS_CLIENT_CERT_FILE",
                    reason: "is required with CONVEYOR_REDIS_CLIENT_KEY_FILE".to_owned(),
                });
            }
        };
        Ok(Some(TlsConfig { connector: config.into(), hostnames: TlsHostMapping::None }))
    }
}

/// The certificates of a PEM file; at least one.
fn certificates(variable: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsFileError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(variable, path, e))?
        .collect::<Result<_, _>>()
        .map_err(|e| file_error(variable, path, e))?;
    if certs.is_empty() {
        return Err(file_error(variable, path, "holds no PEM certificate"));
    }
    Ok(certs)
}
