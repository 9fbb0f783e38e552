//! Source files for asset transfers: `GET /files/{name}` serves deterministic bytes, with what a real origin does
//! (`Range`, `ETag`, `If-Range`, redirects) and what a bad network does (throttling, a dropped connection).
//!
//! Query parameters:
//! - `size` (bytes, default 1 MiB): the file is [`pattern`]`(name, size)`, a seeded pattern whose sha256 a test
//!   computes with [`file_bytes`]; or `format=png&width=W&height=H`: a real PNG image ([`png_bytes`]), so the media
//!   step after a transfer succeeds;
//! - `content_type` (default `application/octet-stream`, `image/png` for `format=png`);
//! - `throttle_kbps`: at most that many KiB per second;
//! - `drip_ms=N` (with `drip_bytes=B`, default 1): a slow drip, B bytes of body every N ms (the first B after N ms
//!   too): a source that sends a byte a second is `drip_ms=1000`;
//! - `drop_after=N`: the first response for this `name` closes the connection after N bytes of body (once per name,
//!   so that a retry can finish);
//! - `no_range=true`: ignore `Range` (answer `200` with the whole file);
//! - `no_length=true`: send no `Content-Length` (a chunked body);
//! - `redirect_to=<url>`: answer `302` to that URL instead;
//! - `changing=true`: the file changes on every request: request `n` (from 0) for this `name` serves the pattern of
//!   [`version_name`]`(name, n)` (a test computes it with [`file_bytes`]), with an `ETag` naming the version;
//! - `no_validator=true`: send neither `ETag` nor `Last-Modified`;
//! - `ignore_if_range=true`: answer a `Range` with `206` even when `If-Range` names another version (a broken
//!   origin or cache).
//!
//! Every byte handed to the connection counts in [`super::Stats::file_bytes_served`], every request in
//! [`super::Stats::file_requests`].

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use serde::Deserialize;

use super::Sandbox;

/// Bytes per body chunk.
const CHUNK: usize = 64 * 1024;

/// What the files remember between requests.
#[derive(Default)]
pub(crate) struct FileState {
    /// Names whose connection was dropped once already.
    dropped: HashSet<String>,
    /// Generated images, by (width, height).
    images: HashMap<(u32, u32), Bytes>,
    /// Requests served so far of each `changing` name.
    versions: HashMap<String, u64>,
}

pub(super) fn routes() -> Router<Sandbox> {
    Router::new().route("/files/{name}", get(serve))
}

#[derive(Deserialize)]
struct FileQuery {
    size: Option<u64>,
    format: Option<String>,
    width: Option<u32>,
    height: Option<u32>,
    content_type: Option<String>,
    throttle_kbps: Option<u64>,
    drip_ms: Option<u64>,
    drip_bytes: Option<u64>,
    drop_after: Option<u64>,
    #[serde(default)]
    no_range: bool,
    #[serde(default)]
    no_length: bool,
    redirect_to: Option<String>,
    #[serde(default)]
    changing: bool,
    #[serde(default)]
    no_validator: bool,
    #[serde(default)]
    ignore_if_range: bool,
}

/// The pattern name of version `version` of a `changing` file `name`.
pub fn version_name(name: &str, version: u64) -> String {
    format!("{name}#v{version}")
}

/// Bytes `range` of the pattern file `name` (a splitmix64 stream seeded by the name's FNV-1a hash).
pub fn pattern(name: &str, range: Range<u64>) -> Vec<u8> {
    let seed = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let mut out = Vec::with_capacity((range.end - range.start) as usize);
    let mut block = range.start / 8;
    let mut skip = (range.start % 8) as usize;
    while (out.len() as u64) < range.end - range.start {
        let mut z = seed.wrapping_add(block.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let want = (range.end - range.start) as usize - out.len();
        let bytes = z.to_le_bytes();
        let take = (8 - skip).min(want);
        out.extend_from_slice(&bytes[skip..skip + take]);
        skip = 0;
        block += 1;
    }
    out
}

/// The whole pattern file `name` of `size` bytes, as served.
pub fn file_bytes(name: &str, size: u64) -> Vec<u8> {
    pattern(name, 0..size)
}

/// A `width` × `height` PNG of noisy pixels (it hardly compresses), as served for `format=png`.
pub fn png_bytes(width: u32, height: u32) -> Vec<u8> {
    let pixels = pattern("png", 0..u64::from(width) * u64::from(height) * 3);
    let image = image::RgbImage::from_raw(width, height, pixels).expect("the buffer has width × height pixels");
    let mut out = std::io::Cursor::new(Vec::new());
    image.write_to(&mut out, image::ImageFormat::Png).expect("a PNG encodes in memory");
    out.into_inner()
}

/// The requested `Range: bytes=a-[b]` of a file of `size` bytes, if one is asked and satisfiable.
fn requested_range(headers: &HeaderMap, size: u64) -> Option<Result<Range<u64>, ()>> {
    let value = headers.get(header::RANGE)?.to_str().ok()?;
    let spec = value.strip_prefix("bytes=")?;
    let (start, end) = spec.split_once('-')?;
    let start: u64 = start.trim().parse().ok()?;
    let end = match end.trim() {
        "" => size,
        e => e.parse::<u64>().ok()?.saturating_add(1).min(size),
    };
    Some(if start < end { Ok(start..end) } else { Err(()) })
}

async fn serve(
    State(sandbox): State<Sandbox>,
    Path(name): Path<String>,
    Query(query): Query<FileQuery>,
    headers: HeaderMap,
) -> Response {
    let drop_now = {
        let mut inner = sandbox.0.lock().expect("sandbox lock");
        inner.stats.file_requests += 1;
        query.drop_after.is_some() && inner.files.dropped.insert(name.clone())
    };
    let version = query.changing.then(|| {
        let mut inner = sandbox.0.lock().expect("sandbox lock");
        let next = inner.files.versions.entry(name.clone()).or_insert(0);
        *next += 1;
        *next - 1
    });
    if let Some(target) = &query.redirect_to {
        return (StatusCode::FOUND, [(header::LOCATION, target.clone())]).into_response();
    }
    let image = match query.format.as_deref() {
        None => None,
        Some("png") => {
            let (w, h) = (query.width.unwrap_or(64).clamp(1, 4096), query.height.unwrap_or(64).clamp(1, 4096));
            let mut inner = sandbox.0.lock().expect("sandbox lock");
            Some(inner.files.images.entry((w, h)).or_insert_with(|| Bytes::from(png_bytes(w, h))).clone())
        }
        Some(_) => return (StatusCode::BAD_REQUEST, "format must be png").into_response(),
    };
    let size = image.as_ref().map_or(query.size.unwrap_or(1024 * 1024), |i| i.len() as u64);
    let etag = match version {
        Some(version) => format!("\"{name}-{size}-v{version}\""),
        None => format!("\"{name}-{size}-{}\"", query.format.as_deref().unwrap_or("pattern")),
    };
    let content_type = query
        .content_type
        .clone()
        .unwrap_or_else(|| if image.is_some() { "image/png" } else { "application/octet-stream" }.to_owned());

    let if_range_ok = query.ignore_if_range
        || headers.get(header::IF_RANGE).is_none_or(|v| !query.no_validator && v.to_str().is_ok_and(|v| v == etag));
    let range = if query.no_range || !if_range_ok { None } else { requested_range(&headers, size) };
    let (status, range) = match range {
        None => (StatusCode::OK, 0..size),
        Some(Ok(range)) => (StatusCode::PARTIAL_CONTENT, range),
        Some(Err(())) => {
            return (StatusCode::RANGE_NOT_SATISFIABLE, [(header::CONTENT_RANGE, format!("bytes */{size}"))])
                .into_response();
        }
    };
    let drop_after = if drop_now { query.drop_after } else { None };
    let pattern_name = version.map_or_else(|| name.clone(), |version| version_name(&name, version));
    let pace = Pace {
        throttle_kbps: query.throttle_kbps.filter(|k| *k > 0),
        drip: query.drip_ms.map(|ms| (Duration::from_millis(ms), query.drip_bytes.unwrap_or(1).max(1))),
    };
    let body = body_stream(sandbox, pattern_name, image, range.clone(), pace, drop_after);
    let mut response = Response::new(Body::from_stream(body));
    *response.status_mut() = status;
    let h = response.headers_mut();
    if !query.no_length {
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(range.end - range.start));
    }
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    if !query.no_validator {
        h.insert(header::LAST_MODIFIED, HeaderValue::from_static("Tue, 01 Dec 2026 00:00:00 GMT"));
        if let Ok(v) = HeaderValue::from_str(&etag) {
            h.insert(header::ETAG, v);
        }
    }
    if let Ok(v) = HeaderValue::from_str(&content_type) {
        h.insert(header::CONTENT_TYPE, v);
    }
    if status == StatusCode::PARTIAL_CONTENT {
        let value = format!("bytes {}-{}/{size}", range.start, range.end - 1);
        h.insert(header::CONTENT_RANGE, HeaderValue::from_str(&value).expect("ASCII"));
    }
    response
}

/// How fast a body is sent.
#[derive(Clone, Copy)]
struct Pace {
    /// At most this many KiB a second.
    throttle_kbps: Option<u64>,
    /// A wait before every chunk, and the chunk's size.
    drip: Option<(Duration, u64)>,
}

/// The body: chunks of the range, paced, counted, and cut after `drop_after` bytes.
fn body_stream(
    sandbox: Sandbox,
    name: String,
    image: Option<Bytes>,
    range: Range<u64>,
    pace: Pace,
    drop_after: Option<u64>,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    let state = (range.start, 0u64);
    futures_util::stream::unfold(state, move |(position, sent)| {
        let (sandbox, name, image) = (sandbox.clone(), name.clone(), image.clone());
        let end = range.end;
        async move {
            if position >= end {
                return None;
            }
            if drop_after.is_some_and(|limit| sent >= limit) {
                // Let the connection flush what was sent before cutting it, as a peer that vanishes would have.
                tokio::time::sleep(Duration::from_millis(100)).await;
                let error = std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "sandbox: dropped");
                return Some((Err(error), (end, sent)));
            }
            let mut len = (end - position).min(CHUNK as u64);
            if let Some((_, bytes)) = pace.drip {
                len = len.min(bytes);
            }
            if let Some(limit) = drop_after {
                len = len.min(limit - sent).max(1);
            }
            if let Some((every, _)) = pace.drip {
                tokio::time::sleep(every).await;
            }
            if let Some(kbps) = pace.throttle_kbps {
                tokio::time::sleep(Duration::from_secs_f64(len as f64 / (kbps as f64 * 1024.0))).await;
            }
            let chunk = match &image {
                Some(image) => image.slice(position as usize..(position + len) as usize),
                None => Bytes::from(pattern(&name, position..position + len)),
            };
            sandbox.0.lock().expect("sandbox lock").stats.file_bytes_served += len;
            Some((Ok(chunk), (position + len, sent + len)))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pattern_is_the_same_bytes_whatever_the_range() {
        let whole = file_bytes("a.bin", 1000);
        assert_eq!(whole.len(), 1000);
        assert_eq!(pattern("a.bin", 3..517), whole[3..517]);
        assert_eq!(pattern("a.bin", 999..1000), whole[999..]);
        assert_ne!(file_bytes("b.bin", 1000), whole);
    }

    #[test]
    fn generated_images_decode() {
        let png = png_bytes(32, 16);
        let image = image::load_from_memory(&png).unwrap();
        assert_eq!((image.width(), image.height()), (32, 16));
    }
}
