//! The sandbox AI provider: `POST /v1/ai/generate` with `Idempotency-Key` and `{"kind", "input"}`.
//!
//! It bills like a real provider: the first call with a key makes one charge (`ai_charges`) and stores its result; a
//! repeat with the key answers that result (`200`) and charges nothing. The charge comes first and the latency (or a
//! hang) after it, so a caller that gives up or dies while waiting leaves a charge behind, as with a real provider
//! whose answer is lost: only the key keeps its retry from paying twice.
//!
//! Outputs are deterministic, derived from the input:
//! - `text`: `{"title", "text"}`: the prompt's first eight words in title case, and a sentence naming it;
//! - `category`: `{"category", "path"}`: from keywords of the title and description (`Other` when none matches);
//! - `image`: `{"url", "description", "width", "height"}`: a placeholder URL named by the prompt's SHA-256.
//!
//! Switches: `ai_rate_limited_calls` (the next n calls answer `429` with `Retry-After: ai_retry_after_secs`, no
//! charge), `error_rate` (`503`, no charge), `latency_ms`, `timeout_rate`/`hang_ms`. A prompt or title starting with
//! `REFUSE` is answered `422 CONTENT_REFUSED` (no charge).

use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use rand::Rng;
use serde::Deserialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::Sandbox;

pub(super) fn routes() -> Router<Sandbox> {
    Router::new().route("/v1/ai/generate", post(generate))
}

#[derive(Deserialize)]
struct GenerateRequest {
    kind: String,
    input: Value,
}

fn field<'a>(input: &'a Value, name: &str) -> &'a str {
    input.get(name).and_then(Value::as_str).unwrap_or("")
}

fn title_case(text: &str, words: usize) -> String {
    text.split_whitespace()
        .take(words)
        .map(|w| {
            let mut chars = w.chars();
            chars
                .next()
                .map(|c| c.to_uppercase().chain(chars.flat_map(char::to_lowercase)).collect())
                .unwrap_or_default()
        })
        .collect::<Vec<String>>()
        .join(" ")
}

const CATEGORIES: &[(&[&str], &str, &str)] = &[
    (&["shirt", "dress", "jacket", "shoe", "shoes", "sneaker", "hoodie", "jeans"], "Apparel", "Clothing & Shoes"),
    (&["phone", "laptop", "headphones", "camera", "charger", "tablet", "speaker"], "Electronics", "Electronics"),
    (&["chair", "table", "lamp", "sofa", "mug", "plant", "garden"], "Home & Garden", "Home"),
    (&["book", "novel", "comic", "notebook"], "Books", "Media"),
    (&["ball", "bike", "bicycle", "tent", "yoga", "racket"], "Sports", "Sports & Outdoors"),
];

/// The deterministic output of a task of `kind` on `input`, or `None` for a kind the provider does not know.
fn output(kind: &str, input: &Value) -> Option<Value> {
    match kind {
        "text" => {
            let prompt = field(input, "prompt");
            let title = title_case(prompt, 8);
            let words = prompt.split_whitespace().count();
            Some(
                json!({ "title": title, "text": format!("{title}: sandbox text written from a {words}-word prompt.") }),
            )
        }
        "category" => {
            let words = format!("{} {}", field(input, "title"), field(input, "description")).to_lowercase();
            let found = CATEGORIES
                .iter()
                .find(|(keys, _, _)| words.split(|c: char| !c.is_alphanumeric()).any(|w| keys.contains(&w)));
            let (category, parent) = found.map(|(_, c, p)| (*c, *p)).unwrap_or(("Other", "Other"));
            Some(json!({ "category": category, "path": [parent, category] }))
        }
        "image" => {
            let prompt = field(input, "prompt");
            let digest = Sha256::digest(prompt.as_bytes());
            let name: String = digest.iter().take(12).map(|b| format!("{b:02x}")).collect();
            let (width, height) = match input.get("size").and_then(Value::as_str) {
                Some("256x256") => (256, 256),
                Some("512x512") => (512, 512),
                _ => (1024, 1024),
            };
            Some(json!({
                "url": format!("https://sandbox.invalid/ai/images/{name}.png"),
                "description": format!("A placeholder image for: {}", title_case(prompt, 12)),
                "width": width,
                "height": height,
            }))
        }
        _ => None,
    }
}

async fn generate(State(sandbox): State<Sandbox>, headers: HeaderMap, Json(body): Json<GenerateRequest>) -> Response {
    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_owned) else {
        return (StatusCode::BAD_REQUEST, Json(json!({ "code": "IDEMPOTENCY_KEY_REQUIRED" }))).into_response();
    };
    let Some(generated) = output(&body.kind, &body.input) else {
        return (StatusCode::UNPROCESSABLE_ENTITY, Json(json!({ "code": "UNKNOWN_KIND" }))).into_response();
    };
    let refused = ["prompt", "title"].iter().any(|name| field(&body.input, name).starts_with("REFUSE"));
    let (answer, settings) = {
        let mut inner = sandbox.0.lock().expect("sandbox lock");
        inner.stats.ai_calls += 1;
        *inner.stats.ai_calls_by_key.entry(key.clone()).or_default() += 1;
        let settings = inner.settings.clone();
        let fail = rand::rng().random_bool(settings.error_rate.clamp(0.0, 1.0));
        let answer = if settings.ai_rate_limited_calls > 0 {
            inner.settings.ai_rate_limited_calls -= 1;
            let after = settings.ai_retry_after_secs.max(1);
            let mut response = (StatusCode::TOO_MANY_REQUESTS, Json(json!({ "code": "RATE_LIMITED" }))).into_response();
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(after));
            response
        } else if fail {
            (StatusCode::SERVICE_UNAVAILABLE, Json(json!({ "code": "UNAVAILABLE" }))).into_response()
        } else if refused {
            (StatusCode::UNPROCESSABLE_ENTITY, Json(json!({ "code": "CONTENT_REFUSED" }))).into_response()
        } else if let Some(stored) = inner.ai_results.get(&key) {
            (StatusCode::OK, Json(stored.clone())).into_response()
        } else {
            let result = json!({
                "id": format!("gen_{}", uuid::Uuid::new_v4().simple()),
                "charge_id": format!("ch_{}", uuid::Uuid::new_v4().simple()),
                "output": generated,
            });
            inner.ai_results.insert(key, result.clone());
            inner.stats.ai_charges += 1;
            (StatusCode::CREATED, Json(result)).into_response()
        };
        (answer, settings)
    };
    if settings.latency_ms > 0 {
        tokio::time::sleep(Duration::from_millis(settings.latency_ms)).await;
    }
    if rand::rng().random_bool(settings.timeout_rate.clamp(0.0, 1.0)) {
        tokio::time::sleep(Duration::from_millis(if settings.hang_ms == 0 { 30_000 } else { settings.hang_ms })).await;
    }
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_are_derived_from_the_input_alone() {
        let text = output("text", &json!({"prompt": "a RED cotton shirt for summer"})).unwrap();
        assert_eq!(text["title"], "A Red Cotton Shirt For Summer");
        assert_eq!(output("text", &json!({"prompt": "a RED cotton shirt for summer"})).unwrap(), text);
        let category = output("category", &json!({"title": "Wireless headphones, black"})).unwrap();
        assert_eq!(category["category"], "Electronics");
        assert_eq!(output("category", &json!({"title": "Mystery box"})).unwrap()["category"], "Other");
        let image = output("image", &json!({"prompt": "a lamp", "size": "512x512"})).unwrap();
        assert_eq!(image["width"], 512);
        assert!(image["url"].as_str().unwrap().starts_with("https://sandbox.invalid/ai/images/"));
        assert_eq!(output("video", &json!({})), None);
    }
}
