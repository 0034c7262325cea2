//! The RoCE path settings of our QPs: which GID (and so which interface and RoCE version),
//! traffic class, service level, ACK timeout and largest path MTU. Fleets that reserve a
//! lossless class for RoCE need these set on every QP, or traffic lands in a lossy queue and
//! "works on one host, hangs on another".

/// GID, traffic class, service level, ACK timeout and largest path MTU of the QPs a server or
/// client creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpPath {
    /// GID index (default: the RoCE v2 GID carrying the control connection's local address,
    /// else the first RoCE v2 GID with an IPv4 address; `p2p-rdma devices` lists them).
    pub gid_index: Option<u32>,
    /// GRH traffic class (the IP header's DSCP << 2 | ECN on RoCE v2).
    pub traffic_class: u8,
    /// Service level, 0–15.
    pub service_level: u8,
    /// Local ACK timeout exponent, 0–31: an RDMA request unanswered for 4.096 µs × 2^n is sent
    /// again, at most 7 times before the QP fails (0: wait forever). Default: verbs' 18,
    /// about 1.07 s (see [`verbs::QpOptions::timeout`] for the measurement behind it).
    pub ack_timeout: u8,
    /// The largest path MTU our QPs take (256–4096, an IB size; None: the port's active MTU).
    /// A connection runs at the smaller of both ends'.
    pub max_mtu: Option<u32>,
}

impl Default for QpPath {
    fn default() -> Self {
        QpPath {
            gid_index: None,
            traffic_class: 0,
            service_level: 0,
            ack_timeout: verbs::QpOptions::default().timeout,
            max_mtu: None,
        }
    }
}

impl QpPath {
    /// Put these settings, and the control connection's local address (`None`: the GID alone
    /// decides), on QP options.
    pub fn apply(
        &self,
        opts: verbs::QpOptions,
        local_ip: Option<std::net::IpAddr>,
    ) -> verbs::QpOptions {
        verbs::QpOptions {
            gid_index: self.gid_index,
            local_ip,
            traffic_class: self.traffic_class,
            service_level: self.service_level,
            timeout: self.ack_timeout,
            max_path_mtu: self.max_mtu,
            ..opts
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_path_sets_every_qp_setting_it_holds() {
        // the default waits about a second before a resend, never forever (0)
        let d = QpPath::default();
        assert_eq!(d.ack_timeout, 18);
        let o = d.apply(verbs::QpOptions::default(), None);
        assert_eq!(o.timeout, 18);
        let p = QpPath {
            gid_index: Some(3),
            traffic_class: 106,
            service_level: 5,
            ack_timeout: 14,
            max_mtu: Some(1024),
        };
        let ip = Some(std::net::IpAddr::from([10, 0, 0, 1]));
        let o = p.apply(
            verbs::QpOptions {
                max_send_wr: 7,
                timeout: 20,
                ..verbs::QpOptions::default()
            },
            ip,
        );
        assert_eq!(
            (o.gid_index, o.traffic_class, o.service_level, o.timeout),
            (Some(3), 106, 5, 14)
        );
        assert_eq!((o.local_ip, o.max_send_wr), (ip, 7));
        assert_eq!((o.max_path_mtu, d.max_mtu), (Some(1024), None));
    }
}
