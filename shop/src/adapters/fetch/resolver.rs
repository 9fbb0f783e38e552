//! Name resolution for transfers, injectable so tests can make a name resolve anywhere, and the reqwest resolver that
//! applies the address policy to every address before a connection is made.

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;

use super::policy::{AddressPolicy, Refusal};

/// A boxed future of resolved addresses.
pub type Resolving = Pin<Box<dyn Future<Output = io::Result<Vec<IpAddr>>> + Send>>;

/// Resolves a host name to addresses.
pub trait Resolver: Send + Sync + 'static {
    /// Every address `host` resolves to.
    fn resolve(&self, host: &str) -> Resolving;
}

/// The system's resolver, through tokio's `lookup_host`.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemResolver;

impl Resolver for SystemResolver {
    fn resolve(&self, host: &str) -> Resolving {
        let host = host.to_owned();
        Box::pin(async move {
            let addresses = tokio::net::lookup_host((host.as_str(), 0)).await?;
            Ok(addresses.map(|a| a.ip()).collect())
        })
    }
}

/// A name resolved to an address the policy refuses (found in a connection error's source chain).
#[derive(Debug, thiserror::Error)]
#[error("{host} resolves to {address}, {refusal}")]
pub struct ForbiddenAddress {
    /// The name.
    pub host: String,
    /// The refused address.
    pub address: IpAddr,
    /// Why.
    pub refusal: Refusal,
}

/// The resolver reqwest uses: resolves through [`Resolver`], then refuses the name if ANY of its addresses is refused
/// (a name that mixes public and private addresses is treated as hostile, not filtered), so reqwest only ever
/// connects to addresses that were checked, in the same step that resolved them (no second lookup to rebind).
pub(super) struct PolicyResolver {
    pub(super) inner: Arc<dyn Resolver>,
    pub(super) policy: Arc<AddressPolicy>,
}

impl reqwest::dns::Resolve for PolicyResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_owned();
        let (inner, policy) = (self.inner.clone(), self.policy.clone());
        Box::pin(async move {
            let addresses = inner.resolve(&host).await?;
            if addresses.is_empty() {
                return Err(io::Error::new(io::ErrorKind::NotFound, format!("{host} resolves to no address")).into());
            }
            for &address in &addresses {
                if let Err(refusal) = policy.check(address) {
                    return Err(Box::new(ForbiddenAddress { host, address, refusal }) as _);
                }
            }
            let addrs: reqwest::dns::Addrs = Box::new(addresses.into_iter().map(|ip| SocketAddr::new(ip, 0)));
            Ok(addrs)
        })
    }
}
