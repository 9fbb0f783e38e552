//! Certificates of a CA the test makes (rcgen): the CA that signed a server certificate (for `localhost` and
//! `127.0.0.1`) and a client certificate, and another CA that signed neither. Files in a directory of the test's own,
//! removed on drop.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::RedisServerTls;

/// Two CAs of the test's own: the one that signed the servers' and the client's certificates, and another.
pub struct Pki {
    pub dir: PathBuf,
    pub ca_file: PathBuf,
    pub other_ca_file: PathBuf,
    pub server_chain_pem: String,
    pub server_key_pem: String,
    pub client_cert_file: PathBuf,
    pub client_key_file: PathBuf,
}

/// Writes `contents` to `dir/name`; the path.
pub fn write(dir: &Path, name: &str, contents: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

impl Pki {
    /// Makes both CAs and the two certificates.
    pub fn new() -> Self {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
        let dir = std::env::temp_dir().join(format!("conveyor-test-pki-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = |name: &str| {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.distinguished_name.push(rcgen::DnType::CommonName, name);
            let cert = params.self_signed(&key).unwrap();
            (cert.pem(), Issuer::new(params, key))
        };
        let (ca_pem, issuer) = ca("conveyor test CA");
        let (other_ca_pem, _) = ca("another CA");

        let server_key = KeyPair::generate().unwrap();
        let mut server = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        server.subject_alt_names.push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
        let server_cert = server.signed_by(&server_key, &issuer).unwrap();

        let client_key = KeyPair::generate().unwrap();
        let mut client = CertificateParams::new(vec!["conveyor-client".to_owned()]).unwrap();
        client.extended_key_usages.push(rcgen::ExtendedKeyUsagePurpose::ClientAuth);
        let client_cert = client.signed_by(&client_key, &issuer).unwrap();

        Pki {
            ca_file: write(&dir, "ca.pem", &ca_pem),
            other_ca_file: write(&dir, "other-ca.pem", &other_ca_pem),
            server_chain_pem: format!("{}{ca_pem}", server_cert.pem()),
            server_key_pem: server_key.serialize_pem(),
            client_cert_file: write(&dir, "client.pem", &client_cert.pem()),
            client_key_file: write(&dir, "client-key.pem", &client_key.serialize_pem()),
            dir,
        }
    }

    /// The files a TLS-only `redis-server` serves with (its certificate chain and key, the CA of its clients').
    pub fn redis_server(&self) -> RedisServerTls {
        RedisServerTls {
            cert_file: write(&self.dir, "redis.pem", &self.server_chain_pem),
            key_file: write(&self.dir, "redis-key.pem", &self.server_key_pem),
            ca_file: self.ca_file.clone(),
            client_cert_file: self.client_cert_file.clone(),
            client_key_file: self.client_key_file.clone(),
        }
    }

    /// A Redis client's TLS files: this CA and the client certificate.
    pub fn redis_client(&self) -> conveyor_jobs::RedisTls {
        conveyor_jobs::RedisTls {
            ca_file: Some(self.ca_file.clone()),
            client_cert_file: Some(self.client_cert_file.clone()),
            client_key_file: Some(self.client_key_file.clone()),
        }
    }

    /// Sets the Redis TLS variables (the CA and the client certificate) in `vars`.
    pub fn redis_vars(&self, vars: &mut HashMap<String, String>) {
        vars.insert("CONVEYOR_REDIS_CA_FILE".into(), self.ca_file.display().to_string());
        vars.insert("CONVEYOR_REDIS_CLIENT_CERT_FILE".into(), self.client_cert_file.display().to_string());
        vars.insert("CONVEYOR_REDIS_CLIENT_KEY_FILE".into(), self.client_key_file.display().to_string());
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
