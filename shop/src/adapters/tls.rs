//! HTTP clients of external systems speak https through rustls, trusting the built-in web roots plus, when
//! `CONVEYOR_TLS_CA_FILE` names one, a private CA (a company's, or the tests' own).

use std::path::Path;

/// Why the client cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The CA file cannot be read.
    #[error("CONVEYOR_TLS_CA_FILE cannot be read: {0}")]
    Read(#[from] std::io::Error),
    /// The CA file holds no usable PEM certificate.
    #[error("CONVEYOR_TLS_CA_FILE holds no PEM certificate: {0}")]
    Parse(String),
}

/// A client builder with rustls, the web roots and the certificates of `ca_file`, that follows no redirect (the
/// marketplace, catalog and AI calls carry a store's credentials or a provider key in their bodies and headers, which
/// a `307`/`308` would have re-sent wherever it points; a `3xx` is then read as a refusal); callers add time-outs and
/// policy (the asset fetcher its own checked redirects).
pub fn client_builder(ca_file: Option<&Path>) -> Result<reqwest::ClientBuilder, TlsError> {
    let mut builder =
        reqwest::Client::builder().use_rustls_tls().https_only(false).redirect(reqwest::redirect::Policy::none());
    if let Some(path) = ca_file {
        let pem = std::fs::read(path)?;
        let certificates = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| TlsError::Parse(e.to_string()))?;
        if certificates.is_empty() {
            return Err(TlsError::Parse("no certificate found".into()));
        }
        for certificate in certificates {
            builder = builder.add_root_certificate(certificate);
        }
    }
    Ok(builder)
}
