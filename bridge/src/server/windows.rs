//! One registration per region, a memory window per client.
//!
//! When the device binds type 2 memory windows, the server registers each region's direct part
//! once, at start (or when the region is added), in one protection domain with
//! [`Access::MW_BIND`] and no remote access: the MR's own rkey opens nothing. Every open binds
//! a window over that registration on the client's own QP, with the rights the open was
//! granted (read, or read and write); the window's rkey works on that QP only and dies when
//! the handle closes, the connection ends or the region is removed. Open costs one work
//! request whatever the region's size, and the pages are pinned once.
//!
//! When the device has no memory windows (or a window cannot be proved), the server registers
//! per connection in a protection domain of its own, as before ([`Sharing::PerConnection`]).

use std::ops::Range;
use std::sync::Arc;

use peermem::canary::{register_mode, DeviceMr};
use peermem::Provider;

use crate::path::{register_segments, Segments};
use verbs::{Access, HostBuffer, Local, ProtectionDomain, QpOptions, QueuePair, RegMode};

/// How the server gives clients access to a region's direct part.
#[derive(Debug, Clone)]
pub(super) enum Sharing {
    /// One registration per region in the server's PD; a window per open.
    Windows,
    /// A registration per connection, in the connection's own PD (why windows are not used).
    PerConnection(String),
}

impl Sharing {
    /// Whether windows are used.
    pub(super) fn windows(&self) -> bool {
        matches!(self, Sharing::Windows)
    }

    /// A line for logs and reasons.
    pub(super) fn describe(&self) -> String {
        match self {
            Sharing::Windows => "one registration per region; each open binds a memory window \
                                 on the client's QP"
                .into(),
            Sharing::PerConnection(why) => {
                format!("each connection registers the regions it opens ({why})")
            }
        }
    }
}

/// Why a server that serves read-only memory registers per connection.
pub(super) fn read_only_reason(region: &str) -> String {
    format!(
        "region '{region}' is read-only memory, and a memory window needs an MR registered with \
         MW_BIND, which the kernel pins for writing (ib_access_writable)"
    )
}

fn loopback(pd: &ProtectionDomain) -> verbs::Result<(QueuePair, QueuePair)> {
    let opts = QpOptions {
        memory_windows: true,
        max_send_wr: 4,
        max_recv_wr: 1,
        ..QpOptions::default()
    };
    QueuePair::loopback_pair(pd, opts)
}

/// Read `range` of `mr` through a window bound on a loopback QP; the bytes read.
async fn read_through_window(
    pd: &ProtectionDomain,
    mr: Arc<dyn verbs::RegionRef>,
    range: Range<u64>,
) -> verbs::Result<Vec<u8>> {
    let (a, b) = loopback(pd)?;
    let n = (range.end - range.start) as usize;
    let w = b
        .bind_window(mr, range.clone(), Access::REMOTE_READ)
        .await?;
    let dst = pd.register(HostBuffer::new(n)?, Access::LOCAL_WRITE, RegMode::Pinned)?;
    let got = a.read(Local::owned(dst), w.remote()).await?;
    Ok(got.bytes().map(<[u8]>::to_vec).unwrap_or_default())
}

/// Whether this device binds type 2 windows on our QPs and serves a READ through one: tried
/// on a small host buffer.
pub(super) async fn probe(pd: &ProtectionDomain) -> Sharing {
    let res = async {
        let mut mem = HostBuffer::new(4096)?;
        for (i, b) in mem.as_mut_slice().iter_mut().enumerate() {
            *b = (i * 13 + 5) as u8;
        }
        let want = mem.as_slice().to_vec();
        let mr = Arc::new(pd.register(mem, Access::MW_BIND, RegMode::Pinned)?);
        let got = read_through_window(pd, mr, 0..4096).await?;
        Ok::<_, verbs::Error>(got == want)
    }
    .await;
    match res {
        Ok(true) => Sharing::Windows,
        Ok(false) => Sharing::PerConnection(
            "a READ through a memory window returned other bytes than the memory holds".into(),
        ),
        Err(e) => Sharing::PerConnection(format!("memory windows do not work here: {e}")),
    }
}

/// What [`share`] registered: an MR per segment, and, when a segment after the first was
/// refused, the segments kept and why the next one was not.
pub(super) type Shared = (Vec<Arc<DeviceMr>>, Option<(Segments, String)>);

/// Register a region's direct part once, an MR per segment, for windows (local write only
/// when clients may write it), and prove a window over the first and the last MR: a READ
/// through it returns what the CPU sees. Pinning every page takes long for a large region:
/// done off the async workers.
pub(super) async fn share(
    pd: &ProtectionDomain,
    name: &str,
    provider: &Arc<dyn Provider>,
    segments: Segments,
    mode: RegMode,
    writable: bool,
) -> Result<Shared, String> {
    if !provider.writable() {
        return Err(read_only_reason(name));
    }
    let access = if writable {
        Access::MW_BIND | Access::LOCAL_WRITE
    } else {
        Access::MW_BIND
    };
    let (pd2, p2) = (pd.clone(), Arc::clone(provider));
    let (mrs, short) = tokio::task::spawn_blocking(move || {
        register_segments(segments, |r| {
            register_mode(&pd2, &p2, r, access, mode).map(Arc::new)
        })
    })
    .await
    .map_err(|e| format!("registration task: {e}"))?;
    if mrs.is_empty() {
        let why = short.map(|(_, why)| why).unwrap_or_default();
        return Err(format!(
            "registering the direct part once ({mode}, {access}): {why}"
        ));
    }
    let kept = short.as_ref().map_or(segments, |(k, _)| *k);
    let ranges = kept.ranges();
    let mut check = vec![0];
    if ranges.len() > 1 {
        check.push(ranges.len() - 1);
    }
    for i in check {
        let (mr, r) = (&mrs[i], &ranges[i]);
        let n = (r.end - r.start).min(4096);
        let got = read_through_window(pd, mr.clone(), 0..n)
            .await
            .map_err(|e| format!("a memory window over the {mode} registration: {e}"))?;
        let mut want = vec![0u8; n as usize];
        provider
            .copy_out(r.start, &mut want)
            .map_err(|e| format!("reading the region to check the window: {e}"))?;
        if got != want {
            return Err(format!(
                "a READ through a memory window over the {mode} registration of bytes {}.. \
                 returned other bytes than the CPU sees",
                r.start
            ));
        }
    }
    Ok((mrs, short))
}
