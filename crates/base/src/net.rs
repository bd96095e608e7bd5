//! Network interfaces: names, addresses, MTU, up/down; and which interface owns an address.
//!
//! Read with getifaddrs(3) plus /sys/class/net/<name>/mtu, so no extra dependency is needed
//! and the answer is the kernel's own.

use std::collections::BTreeMap;
use std::net::IpAddr;

use nix::net::if_::InterfaceFlags;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Iface {
    pub name: String,
    pub up: bool,
    pub loopback: bool,
    pub mtu: Option<u32>,
    pub addrs: Vec<IpAddr>,
}

/// Every interface of this host, by name.
pub fn interfaces() -> Vec<Iface> {
    let mut by_name: BTreeMap<String, Iface> = BTreeMap::new();
    let Ok(list) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    for ifa in list {
        let e = by_name
            .entry(ifa.interface_name.clone())
            .or_insert_with(|| Iface {
                name: ifa.interface_name.clone(),
                up: ifa.flags.contains(InterfaceFlags::IFF_UP)
                    && ifa.flags.contains(InterfaceFlags::IFF_RUNNING),
                loopback: ifa.flags.contains(InterfaceFlags::IFF_LOOPBACK),
                mtu: std::fs::read_to_string(format!("/sys/class/net/{}/mtu", ifa.interface_name))
                    .ok()
                    .and_then(|s| s.trim().parse().ok()),
                addrs: Vec::new(),
            });
        let ip = ifa.address.as_ref().and_then(|a| {
            a.as_sockaddr_in()
                .map(|v4| IpAddr::V4(v4.ip()))
                .or_else(|| a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
        });
        if let Some(ip) = ip
            && !e.addrs.contains(&ip)
        {
            e.addrs.push(ip);
        }
    }
    by_name.into_values().collect()
}

/// The interface that holds `addr`, if any (IPv4-mapped IPv6 addresses count as IPv4).
pub fn owner(ifaces: &[Iface], addr: IpAddr) -> Option<&Iface> {
    let addr = canonical(addr);
    ifaces
        .iter()
        .find(|i| i.addrs.iter().any(|a| canonical(*a) == addr))
}

/// `::ffff:a.b.c.d` as `a.b.c.d`, so addresses seen by a dual-stack socket compare equal.
pub fn canonical(a: IpAddr) -> IpAddr {
    match a {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(a, IpAddr::V4),
        v4 => v4,
    }
}

/// Addresses other hosts may use to reach this one: up, not loopback, not link-local; IPv4
/// first. Loopback last, for a node on this very host.
pub fn reachable_addrs(ifaces: &[Iface]) -> Vec<IpAddr> {
    let mut v4 = Vec::new();
    let mut v6 = Vec::new();
    let mut lo = Vec::new();
    for i in ifaces.iter().filter(|i| i.up) {
        for a in &i.addrs {
            match a {
                IpAddr::V4(x) if x.is_loopback() => lo.push(*a),
                IpAddr::V4(x) if !x.is_link_local() => v4.push(*a),
                IpAddr::V6(x) if x.is_loopback() => {}
                IpAddr::V6(x) if (x.segments()[0] & 0xffc0) != 0xfe80 => v6.push(*a),
                _ => {}
            }
        }
    }
    v4.extend(v6);
    v4.extend(lo);
    v4
}

/// This host's name (`?` if the system will not say): the one place nrun asks.
pub fn hostname() -> String {
    nix::unistd::gethostname().map_or_else(|_| "?".into(), |h| h.to_string_lossy().into_owned())
}

/// Whether a host name means this machine: localhost, a loopback address, this host's name
/// (or its short form), or one of its addresses. `user@` is ignored.
pub fn is_this_host(label: &str) -> bool {
    let name = label.rsplit('@').next().unwrap_or(label);
    if name == "localhost" {
        return true;
    }
    let bare = name.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return ip.is_loopback()
            || interfaces()
                .iter()
                .any(|i| i.addrs.iter().any(|a| canonical(*a) == canonical(ip)));
    }
    let me = hostname();
    me != "?" && (name == me || me.split('.').next() == Some(name))
}

/// The interface this host would send from to reach `target`. A connected UDP socket sends
/// nothing; it only asks the kernel for the route's source address.
pub fn route_interface(target: std::net::SocketAddr) -> Option<String> {
    route_from(target)?.1
}

/// The source address of this host's route to `target`, and the interface holding it (None:
/// no route). Sends nothing (a connected UDP socket only asks the kernel).
pub fn route_from(target: std::net::SocketAddr) -> Option<(IpAddr, Option<String>)> {
    let bind: std::net::SocketAddr = if target.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let local = std::net::UdpSocket::bind(bind)
        .and_then(|u| u.connect(target).and_then(|_| u.local_addr()))
        .ok()?;
    let dev = owner(&interfaces(), local.ip()).map(|i| i.name.clone());
    Some((canonical(local.ip()), dev))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_host_has_a_loopback_interface() {
        let ifs = interfaces();
        let lo = ifs
            .iter()
            .find(|i| i.loopback)
            .expect("a loopback interface");
        assert!(lo.addrs.contains(&"127.0.0.1".parse().unwrap()));
        assert_eq!(
            owner(&ifs, "::ffff:127.0.0.1".parse().unwrap()).map(|i| &i.name),
            Some(&lo.name)
        );
        assert_eq!(
            reachable_addrs(&ifs).last(),
            Some(&"127.0.0.1".parse().unwrap())
        );
    }
}
