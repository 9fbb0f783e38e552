//! Which addresses a transfer may connect to. Refused by default: every address that reaches the machine itself, its
//! private networks or its cloud's metadata service, and every IPv6 form that embeds such an IPv4 address.
//!
//! `CONVEYOR_ASSET_ALLOWED_NETWORKS` opens CIDRs (development, tests). An allowed network is matched against the
//! address exactly as resolved: `127.0.0.0/8` opens `127.0.0.1` but not its IPv4-mapped form `::ffff:127.0.0.1`,
//! which stays refused. Cloud metadata addresses (`169.254.169.254`, `168.63.129.16`, `fd00:ec2::254`, and every
//! IPv6 form embedding one) are refused unconditionally: no allowed network opens them, not even `169.254.0.0/16`
//! or `0.0.0.0/0` (they hand out the instance's credentials).
//!
//! Ports: a transfer reaches ports 80 and 443 only ([`DEFAULT_PORTS`]), whatever the host (a public name, a literal
//! address, an allowed network); `CONVEYOR_ASSET_ALLOWED_PORTS` adds ports. A source URL and every redirect's target
//! are checked ([`AddressPolicy::check_port`]) before a request is sent.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

/// Why an address is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// `0.0.0.0/8`, `::`: "this host".
    Unspecified,
    /// `127.0.0.0/8`, `::1`.
    Loopback,
    /// `10.0.0.0/8`, `172.16.0.0/12`, `192.168.0.0/16`, `fec0::/10`.
    Private,
    /// `100.64.0.0/10`: carrier-grade NAT, the provider's own network.
    SharedAddressSpace,
    /// `169.254.0.0/16`, `fe80::/10`.
    LinkLocal,
    /// A cloud's instance metadata service (`169.254.169.254`, `fd00:ec2::254`, `168.63.129.16`).
    CloudMetadata,
    /// `224.0.0.0/4`, `ff00::/8`.
    Multicast,
    /// `255.255.255.255`.
    Broadcast,
    /// `192.0.2.0/24`, `198.51.100.0/24`, `203.0.113.0/24`, `2001:db8::/32`, `3fff::/20`.
    Documentation,
    /// `fc00::/7`.
    UniqueLocal,
    /// Every other special-purpose range: `192.0.0.0/24`, `192.88.99.0/24`, `198.18.0.0/15`, `240.0.0.0/4`, and
    /// IPv6 outside global unicast `2000::/3` or inside its special-purpose blocks.
    Reserved,
}

impl Refusal {
    /// A short phrase for messages.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Unspecified => "an unspecified address",
            Self::Loopback => "a loopback address",
            Self::Private => "a private address",
            Self::SharedAddressSpace => "a shared (carrier-grade NAT) address",
            Self::LinkLocal => "a link-local address",
            Self::CloudMetadata => "a cloud metadata address",
            Self::Multicast => "a multicast address",
            Self::Broadcast => "the broadcast address",
            Self::Documentation => "a documentation address",
            Self::UniqueLocal => "a unique local address",
            Self::Reserved => "a reserved address",
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

/// The ports a transfer may reach unless `CONVEYOR_ASSET_ALLOWED_PORTS` adds more: HTTP's and HTTPS's.
pub const DEFAULT_PORTS: [u16; 2] = [80, 443];

/// A port the policy refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("port {port} is not allowed (allowed ports: {allowed})")]
pub struct PortRefused {
    /// The refused port.
    pub port: u16,
    /// The allowed ports, comma-separated, for the message.
    pub allowed: String,
}

/// The address policy: the default refusals, minus the allowed networks; and the allowed ports.
#[derive(Clone, Debug, Default)]
pub struct AddressPolicy {
    allowed: Vec<IpNet>,
    /// Ports allowed besides [`DEFAULT_PORTS`].
    extra_ports: Vec<u16>,
}

impl AddressPolicy {
    /// The default refusals, with `allowed` networks opened; ports 80 and 443 only.
    pub fn new(allowed: Vec<IpNet>) -> Self {
        Self { allowed, extra_ports: Vec::new() }
    }

    /// The same policy with `ports` allowed besides 80 and 443 (`CONVEYOR_ASSET_ALLOWED_PORTS`).
    pub fn with_ports(mut self, ports: impl IntoIterator<Item = u16>) -> Self {
        self.extra_ports.extend(ports);
        self.extra_ports.sort_unstable();
        self.extra_ports.dedup();
        self
    }

    /// Every allowed port, ascending.
    pub fn allowed_ports(&self) -> Vec<u16> {
        let mut ports: Vec<u16> = DEFAULT_PORTS.iter().chain(&self.extra_ports).copied().collect();
        ports.sort_unstable();
        ports.dedup();
        ports
    }

    /// `Err` when a transfer may not connect to `port` (of any host).
    pub fn check_port(&self, port: u16) -> Result<(), PortRefused> {
        if DEFAULT_PORTS.contains(&port) || self.extra_ports.contains(&port) {
            return Ok(());
        }
        let allowed = self.allowed_ports().iter().map(u16::to_string).collect::<Vec<_>>().join(", ");
        Err(PortRefused { port, allowed })
    }

    /// `Err` with the reason when a transfer may not connect to `address`. A cloud metadata address is refused
    /// whatever the allowed networks.
    pub fn check(&self, address: IpAddr) -> Result<(), Refusal> {
        if default_refusal(address) == Some(Refusal::CloudMetadata) {
            return Err(Refusal::CloudMetadata);
        }
        if self.allowed.iter().any(|net| net.contains(&address)) {
            return Ok(());
        }
        match default_refusal(address) {
            Some(refusal) => Err(refusal),
            None => Ok(()),
        }
    }
}

/// Why `address` is refused when no network is allowed, if it is.
pub fn default_refusal(address: IpAddr) -> Option<Refusal> {
    match address {
        IpAddr::V4(v4) => v4_refusal(v4),
        IpAddr::V6(v6) => v6_refusal(v6),
    }
}

fn in_v4(address: Ipv4Addr, network: [u8; 4], prefix: u32) -> bool {
    let mask = if prefix == 0 { 0 } else { u32::MAX << (32 - prefix) };
    u32::from(address) & mask == u32::from(Ipv4Addr::from(network)) & mask
}

fn in_v6(address: Ipv6Addr, network: Ipv6Addr, prefix: u32) -> bool {
    let mask = if prefix == 0 { 0 } else { u128::MAX << (128 - prefix) };
    u128::from(address) & mask == u128::from(network) & mask
}

fn v4_refusal(a: Ipv4Addr) -> Option<Refusal> {
    use Refusal::*;
    // Most specific first: the metadata service sits inside link-local, broadcast inside 240/4.
    let table: &[([u8; 4], u32, Refusal)] = &[
        ([169, 254, 169, 254], 32, CloudMetadata),
        ([168, 63, 129, 16], 32, CloudMetadata),
        ([255, 255, 255, 255], 32, Broadcast),
        ([0, 0, 0, 0], 8, Unspecified),
        ([10, 0, 0, 0], 8, Private),
        ([100, 64, 0, 0], 10, SharedAddressSpace),
        ([127, 0, 0, 0], 8, Loopback),
        ([169, 254, 0, 0], 16, LinkLocal),
        ([172, 16, 0, 0], 12, Private),
        ([192, 0, 0, 0], 24, Reserved),
        ([192, 0, 2, 0], 24, Documentation),
        ([192, 88, 99, 0], 24, Reserved),
        ([192, 168, 0, 0], 16, Private),
        ([198, 18, 0, 0], 15, Reserved),
        ([198, 51, 100, 0], 24, Documentation),
        ([203, 0, 113, 0], 24, Documentation),
        ([224, 0, 0, 0], 4, Multicast),
        ([240, 0, 0, 0], 4, Reserved),
    ];
    table.iter().find(|(net, prefix, _)| in_v4(a, *net, *prefix)).map(|(_, _, refusal)| *refusal)
}

const fn v6(segments: [u16; 8]) -> Ipv6Addr {
    Ipv6Addr::new(
        segments[0],
        segments[1],
        segments[2],
        segments[3],
        segments[4],
        segments[5],
        segments[6],
        segments[7],
    )
}

/// The IPv4 address an IPv6 address carries, for the forms that route to it: IPv4-mapped `::ffff:0:0/96`,
/// IPv4-compatible `::/96`, NAT64 `64:ff9b::/96`, 6to4 `2002::/16` (bits 16 to 47). Teredo is handled apart (it
/// carries two).
fn embedded_v4(a: Ipv6Addr) -> Option<Ipv4Addr> {
    let bits = u128::from(a);
    let low = Ipv4Addr::from(bits as u32);
    if in_v6(a, v6([0, 0, 0, 0, 0, 0xffff, 0, 0]), 96)
        || in_v6(a, Ipv6Addr::UNSPECIFIED, 96)
        || in_v6(a, v6([0x64, 0xff9b, 0, 0, 0, 0, 0, 0]), 96)
    {
        return Some(low);
    }
    if in_v6(a, v6([0x2002, 0, 0, 0, 0, 0, 0, 0]), 16) {
        return Some(Ipv4Addr::from((bits >> 80) as u32));
    }
    None
}

fn v6_refusal(a: Ipv6Addr) -> Option<Refusal> {
    use Refusal::*;
    if a == Ipv6Addr::UNSPECIFIED {
        return Some(Unspecified);
    }
    if a == Ipv6Addr::LOCALHOST {
        return Some(Loopback);
    }
    if a == v6([0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254]) {
        return Some(CloudMetadata);
    }
    if let Some(v4) = embedded_v4(a) {
        // The IPv4 address decides; an embedding of a public address is as good as the address itself. The
        // IPv4-compatible form is deprecated, but some stacks still route it.
        return v4_refusal(v4);
    }
    if in_v6(a, v6([0x2001, 0, 0, 0, 0, 0, 0, 0]), 32) {
        // Teredo: the server's IPv4 in bits 32 to 63, the client's, inverted, in the last 32 bits.
        let bits = u128::from(a);
        let server = Ipv4Addr::from((bits >> 64) as u32);
        let client = Ipv4Addr::from(!(bits as u32));
        return v4_refusal(server).or_else(|| v4_refusal(client));
    }
    let table: &[(Ipv6Addr, u32, Refusal)] = &[
        (v6([0xff00, 0, 0, 0, 0, 0, 0, 0]), 8, Multicast),
        (v6([0xfe80, 0, 0, 0, 0, 0, 0, 0]), 10, LinkLocal),
        (v6([0xfec0, 0, 0, 0, 0, 0, 0, 0]), 10, Private),
        (v6([0xfc00, 0, 0, 0, 0, 0, 0, 0]), 7, UniqueLocal),
        (v6([0x2001, 0x0db8, 0, 0, 0, 0, 0, 0]), 32, Documentation),
        (v6([0x3fff, 0, 0, 0, 0, 0, 0, 0]), 20, Documentation),
        (v6([0x2001, 0, 0, 0, 0, 0, 0, 0]), 23, Reserved),
        (v6([0x0064, 0xff9b, 0x0001, 0, 0, 0, 0, 0]), 48, Reserved),
    ];
    if let Some((_, _, refusal)) = table.iter().find(|(net, prefix, _)| in_v6(a, *net, *prefix)) {
        return Some(*refusal);
    }
    // Only global unicast is reachable on the internet.
    (!in_v6(a, v6([0x2000, 0, 0, 0, 0, 0, 0, 0]), 3)).then_some(Reserved)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(text: &str) -> Option<Refusal> {
        default_refusal(text.parse().unwrap())
    }

    #[test]
    fn ipv4_special_ranges_are_refused_with_their_reason() {
        use Refusal::*;
        let cases = [
            ("0.0.0.0", Unspecified),
            ("0.1.2.3", Unspecified),
            ("127.0.0.1", Loopback),
            ("127.255.255.254", Loopback),
            ("10.0.0.1", Private),
            ("10.255.255.255", Private),
            ("172.16.0.1", Private),
            ("172.31.255.255", Private),
            ("192.168.1.1", Private),
            ("100.64.0.1", SharedAddressSpace),
            ("100.127.255.255", SharedAddressSpace),
            ("169.254.0.1", LinkLocal),
            ("169.254.169.254", CloudMetadata),
            ("168.63.129.16", CloudMetadata),
            ("224.0.0.1", Multicast),
            ("239.255.255.250", Multicast),
            ("255.255.255.255", Broadcast),
            ("240.0.0.1", Reserved),
            ("192.0.0.8", Reserved),
            ("192.88.99.1", Reserved),
            ("198.18.0.1", Reserved),
            ("198.19.255.255", Reserved),
            ("192.0.2.1", Documentation),
            ("198.51.100.7", Documentation),
            ("203.0.113.9", Documentation),
        ];
        for (address, expected) in cases {
            assert_eq!(refusal(address), Some(expected), "{address}");
        }
    }

    #[test]
    fn public_ipv4_addresses_and_range_neighbours_are_allowed() {
        for address in [
            "1.1.1.1",
            "8.8.8.8",
            "93.184.216.34",
            "9.255.255.255",
            "11.0.0.0",
            "100.63.255.255",
            "100.128.0.0",
            "126.255.255.255",
            "128.0.0.0",
            "169.253.255.255",
            "169.255.0.0",
            "172.15.255.255",
            "172.32.0.0",
            "192.167.255.255",
            "192.169.0.0",
            "198.17.255.255",
            "198.20.0.0",
            "223.255.255.255",
        ] {
            assert_eq!(refusal(address), None, "{address}");
        }
    }

    #[test]
    fn ipv6_special_ranges_are_refused_with_their_reason() {
        use Refusal::*;
        let cases = [
            ("::", Unspecified),
            ("::1", Loopback),
            ("fe80::1", LinkLocal),
            ("febf:ffff::1", LinkLocal),
            ("fec0::1", Private),
            ("fc00::1", UniqueLocal),
            ("fdff:ffff::1", UniqueLocal),
            ("fd00:ec2::254", CloudMetadata),
            ("ff02::1", Multicast),
            ("ff0e::1", Multicast),
            ("2001:db8::1", Documentation),
            ("3fff::1", Documentation),
            ("2001:2::1", Reserved),
            ("2001:10::1", Reserved),
            ("64:ff9b:1::1", Reserved),
            ("100::1", Reserved),
            ("4000::1", Reserved),
            ("::2:0:0:1", Reserved),
        ];
        for (address, expected) in cases {
            assert_eq!(refusal(address), Some(expected), "{address}");
        }
    }

    #[test]
    fn ipv6_forms_embedding_ipv4_are_judged_by_the_ipv4_address() {
        use Refusal::*;
        let cases = [
            // IPv4-mapped.
            ("::ffff:127.0.0.1", Some(Loopback)),
            ("::ffff:7f00:1", Some(Loopback)),
            ("::ffff:10.1.2.3", Some(Private)),
            ("::ffff:169.254.169.254", Some(CloudMetadata)),
            ("::ffff:0.0.0.0", Some(Unspecified)),
            ("::ffff:8.8.8.8", None),
            // IPv4-compatible (deprecated).
            ("::127.0.0.1", Some(Loopback)),
            ("::192.168.0.1", Some(Private)),
            ("::8.8.8.8", None),
            // NAT64.
            ("64:ff9b::127.0.0.1", Some(Loopback)),
            ("64:ff9b::a9fe:a9fe", Some(CloudMetadata)),
            ("64:ff9b::8.8.8.8", None),
            // 6to4: bits 16 to 47.
            ("2002:7f00:1::", Some(Loopback)),
            ("2002:a00:1::1", Some(Private)),
            ("2002:a9fe:a9fe::1", Some(CloudMetadata)),
            ("2002:808:808::1", None),
            // Teredo: server 65.54.227.120 (public) and client inverted in the last 32 bits.
            ("2001:0:4136:e378:8000:63bf:80ff:fffe", Some(Loopback)), // client !0x80fffffe = 127.0.0.1
            ("2001:0:4136:e378:8000:63bf:f5ff:fffe", Some(Private)),  // client 10.0.0.1
            ("2001:0:7f00:1:8000:63bf:f7f7:f7f7", Some(Loopback)),    // server 127.0.0.1, client 8.8.8.8
            ("2001:0:4136:e378:8000:63bf:f7f7:f7f7", None),           // server 65.54.227.120, client 8.8.8.8
        ];
        for (address, expected) in cases {
            assert_eq!(refusal(address), expected, "{address}");
        }
    }

    #[test]
    fn public_ipv6_addresses_are_allowed() {
        for address in ["2606:4700:4700::1111", "2a00:1450:4001:81b::200e", "2001:4860:4860::8888", "2400:cb00::1"] {
            assert_eq!(refusal(address), None, "{address}");
        }
    }

    #[test]
    fn allowed_networks_open_exactly_their_addresses() {
        let policy = AddressPolicy::new(vec!["127.0.0.0/8".parse().unwrap(), "fd12::/16".parse().unwrap()]);
        assert_eq!(policy.check("127.0.0.1".parse().unwrap()), Ok(()));
        assert_eq!(policy.check("fd12::5".parse().unwrap()), Ok(()));
        assert_eq!(
            policy.check("::ffff:127.0.0.1".parse().unwrap()),
            Err(Refusal::Loopback),
            "mapped form stays refused"
        );
        assert_eq!(policy.check("::1".parse().unwrap()), Err(Refusal::Loopback));
        assert_eq!(policy.check("10.0.0.1".parse().unwrap()), Err(Refusal::Private));
        assert_eq!(policy.check("169.254.169.254".parse().unwrap()), Err(Refusal::CloudMetadata));
        assert_eq!(policy.check("8.8.8.8".parse().unwrap()), Ok(()));
        assert_eq!(AddressPolicy::default().check("127.0.0.1".parse().unwrap()), Err(Refusal::Loopback));
    }

    #[test]
    fn only_ports_80_and_443_are_allowed_unless_more_are_configured() {
        let policy = AddressPolicy::default();
        assert_eq!(policy.check_port(80), Ok(()));
        assert_eq!(policy.check_port(443), Ok(()));
        for port in [0, 1, 22, 25, 81, 442, 444, 3000, 5432, 6379, 8080, 8443, 9090, 65535] {
            let refused = policy.check_port(port).unwrap_err();
            assert_eq!(refused.port, port);
            assert_eq!(refused.to_string(), format!("port {port} is not allowed (allowed ports: 80, 443)"));
        }
        // Allowed networks open addresses, not ports.
        let loopback = AddressPolicy::new(vec!["127.0.0.0/8".parse().unwrap()]);
        assert!(loopback.check_port(8080).is_err());

        let more = AddressPolicy::new(Vec::new()).with_ports([8443, 8080, 8443, 443]);
        assert_eq!(more.allowed_ports(), vec![80, 443, 8080, 8443]);
        for port in [80, 443, 8080, 8443] {
            assert_eq!(more.check_port(port), Ok(()), "{port}");
        }
        assert_eq!(
            more.check_port(9090).unwrap_err().to_string(),
            "port 9090 is not allowed (allowed ports: 80, 443, 8080, 8443)"
        );
        // Adding ports never removes the defaults.
        assert_eq!(AddressPolicy::default().with_ports([]).allowed_ports(), vec![80, 443]);
    }

    #[test]
    fn no_allowed_network_opens_a_cloud_metadata_address() {
        let everything = AddressPolicy::new(vec![
            "0.0.0.0/0".parse().unwrap(),
            "::/0".parse().unwrap(),
            "169.254.0.0/16".parse().unwrap(),
            "168.63.129.16/32".parse().unwrap(),
        ]);
        for metadata in
            ["169.254.169.254", "168.63.129.16", "fd00:ec2::254", "::ffff:169.254.169.254", "64:ff9b::a9fe:a9fe"]
        {
            assert_eq!(everything.check(metadata.parse().unwrap()), Err(Refusal::CloudMetadata), "{metadata}");
        }
        // The rest of what they allow is open.
        assert_eq!(everything.check("169.254.10.10".parse().unwrap()), Ok(()));
        assert_eq!(everything.check("10.0.0.1".parse().unwrap()), Ok(()));
    }
}
