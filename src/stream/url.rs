//! `CONVEYOR_REDIS_URL` as fred reads it. A cluster (or sentinel) URL may list its seed nodes with commas, the form
//! operators write (`redis-cluster://10.0.0.1:6379,10.0.0.2:6379`); fred wants one host and the others as `node`
//! query parameters (`redis-cluster://10.0.0.1:6379?node=10.0.0.2:6379`). Both forms are accepted.

use std::borrow::Cow;

/// The URL in fred's form: a comma-separated host list of a `redis-cluster://` or `redis-sentinel://` URL becomes
/// its first host plus one `node` parameter per other host; anything else is returned unchanged.
pub(crate) fn fred_url(url: &str) -> Cow<'_, str> {
    let Some((scheme, rest)) = url.split_once("://") else { return Cow::Borrowed(url) };
    if !(scheme.ends_with("-cluster") || scheme.ends_with("-sentinel")) {
        return Cow::Borrowed(url);
    }
    // The authority ends at the first `/` or `?` after the credentials (a password may hold either, so look from
    // the last `@`).
    let host_start = rest.rfind('@').map_or(0, |at| at + 1);
    let host_end = rest[host_start..].find(['/', '?']).map_or(rest.len(), |i| host_start + i);
    let hosts = &rest[host_start..host_end];
    if !hosts.contains(',') {
        return Cow::Borrowed(url);
    }
    let mut hosts = hosts.split(',').map(str::trim).filter(|h| !h.is_empty());
    let first = hosts.next().unwrap_or_default();
    let nodes: Vec<String> = hosts.map(|h| format!("node={h}")).collect();
    let (path, query) = match rest[host_end..].split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (&rest[host_end..], None),
    };
    let mut params = nodes.join("&");
    if let Some(query) = query.filter(|q| !q.is_empty()) {
        params = format!("{query}&{params}");
    }
    Cow::Owned(format!("{scheme}://{}{first}{path}?{params}", &rest[..host_start]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comma_separated_cluster_seeds_become_node_parameters() {
        assert_eq!(
            fred_url("redis-cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002"),
            "redis-cluster://127.0.0.1:7000?node=127.0.0.1:7001&node=127.0.0.1:7002"
        );
        assert_eq!(
            fred_url("redis-cluster://u:p,w@d@a:1,b:2?x=y"),
            "redis-cluster://u:p,w@d@a:1?x=y&node=b:2",
            "credentials are kept whole, and other parameters too"
        );
        assert_eq!(
            fred_url("redis-sentinel://a:26379,b:26379/0?sentinelServiceName=main"),
            "redis-sentinel://a:26379/0?sentinelServiceName=main&node=b:26379"
        );
        for unchanged in ["redis://127.0.0.1:6379", "redis-cluster://a:1?node=b:2", "redis://u:p,q@127.0.0.1:6379/0"] {
            assert_eq!(fred_url(unchanged), unchanged);
        }
    }
}
