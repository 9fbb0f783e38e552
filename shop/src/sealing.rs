//! Credentials at rest: AES-256-GCM with a random 96-bit nonce per seal.
//!
//! The associated data binds a ciphertext to its workspace and store, so a sealed blob copied onto another row
//! does not open.

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Key, Nonce};
use rand::RngCore;

use conveyor_jobs::Secret;

/// Seals and opens secrets with the configured key.
#[derive(Clone)]
pub struct Sealer {
    cipher: Aes256Gcm,
    key_id: String,
}

/// A sealed value as stored.
pub struct Sealed {
    /// Which key sealed it.
    pub key_id: String,
    /// The 12-byte nonce.
    pub nonce: Vec<u8>,
    /// Ciphertext with its tag.
    pub ciphertext: Vec<u8>,
}

/// Opening failed: wrong key, wrong associated data, or a tampered blob.
#[derive(Debug, thiserror::Error)]
#[error("sealed value could not be opened")]
pub struct OpenError;

impl Sealer {
    /// A sealer over a 32-byte key. `key_id` is stored with each seal for rotation.
    pub fn new(key: &Secret<Vec<u8>>, key_id: &str) -> Self {
        let cipher = Aes256Gcm::new(Key::<Aes256Gcm>::from_slice(key.expose()));
        Self { cipher, key_id: key_id.to_owned() }
    }

    /// Seals `plaintext`, bound to `aad`.
    pub fn seal(&self, plaintext: &[u8], aad: &[u8]) -> Sealed {
        let mut nonce = [0u8; 12];
        rand::rng().fill_bytes(&mut nonce);
        let ciphertext = self
            .cipher
            .encrypt(Nonce::from_slice(&nonce), Payload { msg: plaintext, aad })
            .expect("AES-GCM encryption of an in-memory buffer cannot fail");
        Sealed { key_id: self.key_id.clone(), nonce: nonce.to_vec(), ciphertext }
    }

    /// Opens a sealed value bound to `aad`.
    pub fn open(&self, nonce: &[u8], ciphertext: &[u8], aad: &[u8]) -> Result<Vec<u8>, OpenError> {
        if nonce.len() != 12 {
            return Err(OpenError);
        }
        self.cipher.decrypt(Nonce::from_slice(nonce), Payload { msg: ciphertext, aad }).map_err(|_| OpenError)
    }
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealer").field("key_id", &self.key_id).finish_non_exhaustive()
    }
}
