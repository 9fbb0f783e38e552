//! Object storage: one adapter over the `object_store` crate for every backend (`file://` embedded default,
//! `s3://` in production). The backend is chosen once, from `CONVEYOR_OBJECT_STORE_URL`; nothing after that knows
//! which one it is.
//!
//! A `put` is atomic on every backend (the local store writes a temporary file and renames it; S3 makes an object
//! visible only when its upload completes), so a partial upload never becomes visible under its key.
//! Keys always start with the workspace: `workspaces/<workspace>/<what>/<id>/...` ([`ObjectKey`]).

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, PutPayload};
use uuid::Uuid;

/// Why a storage call failed.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// No object under that key.
    #[error("object not found: {0}")]
    NotFound(String),
    /// The URL in `CONVEYOR_OBJECT_STORE_URL` is not usable.
    #[error("invalid object store URL: {0}")]
    InvalidUrl(String),
    /// The backend failed (disk, network, credentials): worth retrying.
    #[error("object store unavailable: {0}")]
    Backend(String),
}

impl From<object_store::Error> for StorageError {
    fn from(e: object_store::Error) -> Self {
        match e {
            object_store::Error::NotFound { path, .. } => Self::NotFound(path),
            other => Self::Backend(other.to_string()),
        }
    }
}

/// A key in the object store. Built only by the constructors below, so every key carries its workspace.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ObjectKey(Path);

impl ObjectKey {
    /// `workspaces/<workspace>/<collection>/<id>/<name>`: `name` may contain `/`-separated parts of `[A-Za-z0-9._-]`.
    pub fn new(workspace: Uuid, collection: &'static str, id: Uuid, name: &str) -> Self {
        debug_assert!(
            name.split('/').all(|p| !p.is_empty()
                && p != ".."
                && p.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))),
            "object name parts are [A-Za-z0-9._-]"
        );
        Self(Path::from(format!("workspaces/{workspace}/{collection}/{id}/{name}")))
    }

    /// Parses a key stored earlier (in a database row).
    pub fn parse(stored: &str) -> Result<Self, StorageError> {
        let path = Path::parse(stored).map_err(|e| StorageError::InvalidUrl(e.to_string()))?;
        if !stored.starts_with("workspaces/") {
            return Err(StorageError::InvalidUrl(format!("not a Conveyor object key: {stored}")));
        }
        Ok(Self(path))
    }

    /// The key as stored in a database row.
    pub fn as_str(&self) -> &str {
        self.0.as_ref()
    }
}

impl fmt::Debug for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.as_ref())
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.as_ref())
    }
}

/// The object store (cheap to clone).
#[derive(Clone)]
pub struct ObjectStorage {
    store: Arc<dyn ObjectStore>,
    url: String,
}

impl fmt::Debug for ObjectStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectStorage").field("url", &self.url).finish()
    }
}

impl ObjectStorage {
    /// Opens `file:///absolute/dir` (created if missing) or `s3://bucket[/prefix]` (credentials and region from the
    /// standard `AWS_*` variables; `AWS_ENDPOINT` for S3-compatible stores).
    pub fn open(url: &str) -> Result<Self, StorageError> {
        Self::open_with(url, std::iter::empty::<(&str, &str)>())
    }

    /// [`ObjectStorage::open`], with S3 settings given here over those of the environment: `object_store`'s keys
    /// (`aws_access_key_id`, `aws_secret_access_key`, `aws_region`, `aws_endpoint`, `aws_allow_http`, ...), for a
    /// host that holds its credentials elsewhere than in `AWS_*` variables. An unknown key is refused.
    pub fn open_with<K: AsRef<str>, V: Into<String>>(
        url: &str,
        s3_options: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Self, StorageError> {
        let parsed = url::Url::parse(url).map_err(|e| StorageError::InvalidUrl(e.to_string()))?;
        let store: Arc<dyn ObjectStore> = match parsed.scheme() {
            "file" => {
                let dir = parsed
                    .to_file_path()
                    .map_err(|_| StorageError::InvalidUrl("file:// URLs need an absolute path".into()))?;
                std::fs::create_dir_all(&dir)
                    .map_err(|e| StorageError::Backend(format!("cannot create {}: {e}", dir.display())))?;
                Arc::new(
                    object_store::local::LocalFileSystem::new_with_prefix(&dir)
                        .map_err(|e| StorageError::InvalidUrl(e.to_string()))?,
                )
            }
            "s3" => {
                let bucket = parsed
                    .host_str()
                    .filter(|b| !b.is_empty())
                    .ok_or_else(|| StorageError::InvalidUrl("s3:// URLs name a bucket: s3://bucket[/prefix]".into()))?;
                let mut builder = object_store::aws::AmazonS3Builder::from_env().with_bucket_name(bucket);
                for (key, value) in s3_options {
                    let key = key.as_ref();
                    let parsed: object_store::aws::AmazonS3ConfigKey =
                        key.parse().map_err(|_| StorageError::InvalidUrl(format!("unknown S3 setting `{key}`")))?;
                    builder = builder.with_config(parsed, value);
                }
                let s3 = builder.build().map_err(|e| StorageError::InvalidUrl(e.to_string()))?;
                let prefix = parsed.path().trim_matches('/');
                if prefix.is_empty() {
                    Arc::new(s3)
                } else {
                    Arc::new(object_store::prefix::PrefixStore::new(s3, prefix))
                }
            }
            other => {
                return Err(StorageError::InvalidUrl(format!("unsupported scheme `{other}`: use file:// or s3://")));
            }
        };
        Ok(Self { store, url: url.to_owned() })
    }

    /// Writes `bytes` under `key`, replacing what was there; visible only once complete.
    pub async fn put(&self, key: &ObjectKey, bytes: Bytes) -> Result<(), StorageError> {
        self.store.put(&key.0, PutPayload::from(bytes)).await?;
        Ok(())
    }

    /// Starts writing an object under `key` in parts ([`PartUpload::put_part`], then [`PartUpload::finish`]): it
    /// becomes visible only once finished; an aborted or dropped upload leaves nothing under `key` (the local store
    /// deletes its staging file; S3 keeps the parts of an upload neither completed nor aborted until a lifecycle rule
    /// removes them).
    pub(crate) async fn start_upload(&self, key: &ObjectKey) -> Result<PartUpload, StorageError> {
        Ok(PartUpload { inner: self.store.put_multipart(&key.0).await? })
    }

    /// Writes the concatenation of `parts` (objects written earlier) under `key` in one upload that becomes visible
    /// only when complete, reading one part at a time. Returns the size written.
    pub async fn concat(&self, key: &ObjectKey, parts: &[ObjectKey]) -> Result<u64, StorageError> {
        let mut upload = object_store::WriteMultipart::new(self.store.put_multipart(&key.0).await?);
        let mut written = 0u64;
        for part in parts {
            let mut stream = self.store.get(&part.0).await?.into_stream();
            while let Some(chunk) = stream.next().await {
                let chunk = chunk?;
                written += chunk.len() as u64;
                upload.wait_for_capacity(4).await?;
                upload.put(chunk);
            }
        }
        upload.finish().await?;
        Ok(written)
    }

    /// The whole object.
    pub async fn get(&self, key: &ObjectKey) -> Result<Bytes, StorageError> {
        Ok(self.store.get(&key.0).await?.bytes().await?)
    }

    /// The object as a stream of chunks (for serving or hashing without holding it whole).
    pub async fn stream(
        &self,
        key: &ObjectKey,
    ) -> Result<impl futures_util::Stream<Item = Result<Bytes, StorageError>> + Send + 'static, StorageError> {
        Ok(self.store.get(&key.0).await?.into_stream().map(|r| r.map_err(StorageError::from)))
    }

    /// Bytes `range` of the object.
    pub async fn get_range(&self, key: &ObjectKey, range: Range<u64>) -> Result<Bytes, StorageError> {
        Ok(self.store.get_range(&key.0, range).await?)
    }

    /// The object's size, or `None` when there is no object under `key`.
    pub async fn size(&self, key: &ObjectKey) -> Result<Option<u64>, StorageError> {
        match self.store.head(&key.0).await {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Deletes the object; deleting a missing object is not an error.
    pub async fn delete(&self, key: &ObjectKey) -> Result<(), StorageError> {
        match self.store.delete(&key.0).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

/// An object being written one part at a time ([`ObjectStorage::start_upload`]).
pub(crate) struct PartUpload {
    inner: Box<dyn object_store::MultipartUpload>,
}

impl fmt::Debug for PartUpload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PartUpload").finish_non_exhaustive()
    }
}

impl PartUpload {
    /// Writes the next part and waits until it is stored (one part in flight: its bytes are freed when this returns).
    /// Every part but the last must be at least 5 MiB on S3.
    pub(crate) async fn put_part(&mut self, bytes: Bytes) -> Result<(), StorageError> {
        self.inner.put_part(PutPayload::from(bytes)).await?;
        Ok(())
    }

    /// Makes the object visible under its key.
    pub(crate) async fn finish(mut self) -> Result<(), StorageError> {
        self.inner.complete().await?;
        Ok(())
    }

    /// Gives up: nothing becomes visible, the parts written are deleted.
    pub(crate) async fn abort(mut self) -> Result<(), StorageError> {
        self.inner.abort().await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_store() -> (ObjectStorage, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("conveyor-storage-{}", Uuid::new_v4().simple()));
        (ObjectStorage::open(&format!("file://{}", dir.display())).unwrap(), dir)
    }

    #[tokio::test]
    async fn objects_round_trip_on_disk_under_workspace_keys() {
        let (store, dir) = temp_store();
        let (ws, id) = (Uuid::new_v4(), Uuid::new_v4());
        let key = ObjectKey::new(ws, "media", id, "original");
        assert_eq!(key.as_str(), format!("workspaces/{ws}/media/{id}/original"));
        assert_eq!(store.size(&key).await.unwrap(), None);
        store.put(&key, Bytes::from_static(b"hello world")).await.unwrap();
        assert_eq!(store.get(&key).await.unwrap(), Bytes::from_static(b"hello world"));
        assert_eq!(store.get_range(&key, 6..11).await.unwrap(), Bytes::from_static(b"world"));
        assert_eq!(store.size(&key).await.unwrap(), Some(11));
        assert!(dir.join(key.as_str()).is_file());
        assert_eq!(ObjectKey::parse(key.as_str()).unwrap(), key);
        store.delete(&key).await.unwrap();
        store.delete(&key).await.unwrap();
        assert!(matches!(store.get(&key).await, Err(StorageError::NotFound(_))));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[tokio::test]
    async fn parts_concatenate_into_one_object() {
        let (store, dir) = temp_store();
        let (ws, id) = (Uuid::new_v4(), Uuid::new_v4());
        let parts: Vec<ObjectKey> = (0..3).map(|i| ObjectKey::new(ws, "t", id, &format!("parts/{i:08}"))).collect();
        for (i, part) in parts.iter().enumerate() {
            store.put(part, Bytes::from(vec![b'a' + i as u8; 10 * 1024 * 1024 + i])).await.unwrap();
        }
        let whole = ObjectKey::new(ws, "t", id, "whole");
        assert_eq!(store.concat(&whole, &parts).await.unwrap(), 30 * 1024 * 1024 + 3);
        let bytes = store.get(&whole).await.unwrap();
        assert_eq!(bytes.len(), 30 * 1024 * 1024 + 3);
        assert_eq!(bytes[10 * 1024 * 1024], b'b');
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[tokio::test]
    async fn an_object_written_in_parts_is_visible_only_once_finished() {
        let (store, dir) = temp_store();
        let (ws, id) = (Uuid::new_v4(), Uuid::new_v4());
        let key = ObjectKey::new(ws, "t", id, "whole");
        let mut upload = store.start_upload(&key).await.unwrap();
        upload.put_part(Bytes::from(vec![b'a'; 5 * 1024 * 1024])).await.unwrap();
        upload.put_part(Bytes::from_static(b"tail")).await.unwrap();
        assert_eq!(store.size(&key).await.unwrap(), None, "not visible before it is finished");
        upload.finish().await.unwrap();
        assert_eq!(store.size(&key).await.unwrap(), Some(5 * 1024 * 1024 + 4));
        let aborted = ObjectKey::new(ws, "t", id, "aborted");
        let mut upload = store.start_upload(&aborted).await.unwrap();
        upload.put_part(Bytes::from_static(b"partial")).await.unwrap();
        upload.abort().await.unwrap();
        assert_eq!(store.size(&aborted).await.unwrap(), None);
        let left: Vec<_> = std::fs::read_dir(dir.join(format!("workspaces/{ws}/t/{id}"))).unwrap().collect();
        assert_eq!(left.len(), 1, "only the finished object is left: {left:?}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn bad_urls_are_refused_with_a_reason() {
        for url in ["ftp://x/y", "not a url", "s3:///prefix", "file://relative"] {
            assert!(matches!(ObjectStorage::open(url), Err(StorageError::InvalidUrl(_))), "{url}");
        }
        assert!(ObjectKey::parse("etc/passwd").is_err());
    }
}
