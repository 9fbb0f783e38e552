//! A marketplace's product catalog, read page by page with the marketplace's own cursor (a full sync). Reading makes
//! no effect on the marketplace, so it needs no idempotency token.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use super::marketplace::MarketplaceError;

/// Most products asked for in one page.
pub const MAX_PAGE_SIZE: u32 = 1000;

/// One product as the marketplace lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CatalogProduct {
    /// The marketplace's id of the product (1 to 200 bytes).
    pub external_id: String,
    /// Title (at most 500 characters).
    pub title: String,
    /// Price as an exact decimal string (`"12.50"`).
    pub price: String,
    /// ISO 4217 code.
    pub currency: String,
}

/// A page of the catalog.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProductPage {
    /// The products, in the marketplace's stable order.
    pub products: Vec<CatalogProduct>,
    /// Where the next page starts; `None` on the last page.
    pub next_cursor: Option<String>,
    /// Products in the whole catalog, when the marketplace says.
    pub total: Option<u64>,
}

impl ProductPage {
    /// Checks what a marketplace answered before any of it is stored.
    pub fn validate(&self, asked: u32) -> Result<(), String> {
        if self.products.len() > asked as usize {
            return Err(format!("a page of {} products was asked for and {} came", asked, self.products.len()));
        }
        if self.next_cursor.as_ref().is_some_and(|c| c.is_empty() || c.len() > 1024) {
            return Err("the next cursor is empty or longer than 1024 bytes".into());
        }
        let mut seen = std::collections::HashSet::with_capacity(self.products.len());
        for p in &self.products {
            if [&p.external_id, &p.title, &p.price, &p.currency].iter().any(|f| f.contains('\0')) {
                return Err("a product field holds a NUL character".into());
            }
            // The id is checked first: the messages below name it, and they end up on the sync's operation.
            if p.external_id.is_empty() || p.external_id.len() > 200 {
                return Err("a product id is empty or longer than 200 bytes".into());
            }
            if !seen.insert(p.external_id.as_str()) {
                return Err(format!("product {} is twice on the page", p.external_id));
            }
            if p.title.chars().count() > 500 {
                return Err(format!("product {} has a title longer than 500 characters", p.external_id));
            }
            if !is_decimal(&p.price) {
                return Err(format!("product {} has a price that is not a decimal", p.external_id));
            }
            if p.currency.len() != 3 || !p.currency.bytes().all(|b| b.is_ascii_uppercase()) {
                return Err(format!("product {} has a currency that is not an ISO 4217 code", p.external_id));
            }
        }
        Ok(())
    }
}

/// `123`, `12.5`, `0.0001`: digits, at most one point, at most 4 decimals, at most 16 integer digits.
fn is_decimal(text: &str) -> bool {
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    (1..=16).contains(&whole.len())
        && digits(whole)
        && fraction.len() <= 4
        && digits(fraction)
        && !(text.contains('.') && fraction.is_empty())
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A marketplace's catalog API.
pub trait Catalog: Send + Sync + 'static {
    /// The page of at most `limit` products starting at `cursor` (`None`: the first page) of the store that
    /// `credentials` open.
    fn list_products<'a>(
        &'a self,
        credentials: &'a BTreeMap<String, String>,
        cursor: Option<&'a str>,
        limit: u32,
    ) -> BoxFuture<'a, Result<ProductPage, MarketplaceError>>;
}

/// The catalog over HTTP: `POST {base}/v1/catalog/list` with `{"credentials", "cursor", "limit"}` (a POST, so that
/// credentials travel in the body, never in a URL that proxies log).
pub struct HttpCatalog {
    base: String,
    http: reqwest::Client,
}

impl HttpCatalog {
    /// A client of the marketplace at `base` with a per-call time-out, trusting `ca_file` besides the web roots.
    pub fn new(base: &str, timeout: Duration, ca_file: Option<&std::path::Path>) -> Result<Self, super::tls::TlsError> {
        let http = super::tls::client_builder(ca_file)?.timeout(timeout).build().expect("an HTTP client builds");
        Ok(Self { base: base.trim_end_matches('/').to_owned(), http })
    }
}

impl Catalog for HttpCatalog {
    fn list_products<'a>(
        &'a self,
        credentials: &'a BTreeMap<String, String>,
        cursor: Option<&'a str>,
        limit: u32,
    ) -> BoxFuture<'a, Result<ProductPage, MarketplaceError>> {
        Box::pin(async move {
            let sent = self
                .http
                .post(format!("{}/v1/catalog/list", self.base))
                .json(&serde_json::json!({ "credentials": credentials, "cursor": cursor, "limit": limit }))
                .send()
                .await;
            let response = super::answer::read(sent).await?;
            let page: ProductPage =
                response.json().await.map_err(|_| MarketplaceError::Permanent("malformed catalog page".into()))?;
            page.validate(limit).map_err(|e| MarketplaceError::Permanent(format!("malformed catalog page: {e}")))?;
            Ok(page)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn product(id: &str, price: &str, currency: &str) -> CatalogProduct {
        CatalogProduct { external_id: id.into(), title: "T".into(), price: price.into(), currency: currency.into() }
    }

    #[test]
    fn a_page_is_checked_before_it_is_stored() {
        let page = |products| ProductPage { products, next_cursor: None, total: None };
        assert!(page(vec![product("a", "12.50", "EUR"), product("b", "3", "USD")]).validate(2).is_ok());
        assert!(page(vec![product("a", "1", "EUR"), product("b", "1", "EUR")]).validate(1).is_err(), "too many");
        assert!(page(vec![product("a", "1", "EUR"), product("a", "2", "EUR")]).validate(5).is_err(), "twice");
        for bad in [
            product("", "1", "EUR"),
            product(&"x".repeat(201), "1", "EUR"),
            product("a", "-1", "EUR"),
            product("a", "1.", "EUR"),
            product("a", "1.23456", "EUR"),
            product("a", "1e3", "EUR"),
            product("a", "", "EUR"),
            product("a", "1", "eur"),
            product("a", "1", "EURO"),
            CatalogProduct { title: "a\0b".into(), ..product("a", "1", "EUR") },
        ] {
            assert!(page(vec![bad.clone()]).validate(10).is_err(), "{bad:?}");
        }
        let long_cursor = ProductPage { products: vec![], next_cursor: Some("c".repeat(1025)), total: None };
        assert!(long_cursor.validate(10).is_err());
    }
}
