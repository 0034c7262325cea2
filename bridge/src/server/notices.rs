//! Put notifications: what an embedding storage node learns of the bytes clients put.

use tokio::sync::broadcast;

use crate::protocol::DataPath;

/// How many notices a slow subscriber may fall behind before it misses some (it is then
/// told how many, by [`broadcast::error::RecvError::Lagged`]).
pub const PUT_NOTICE_BACKLOG: usize = 4096;

/// A put that completed into a region.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PutNotice {
    /// The region.
    pub region: String,
    /// First byte written.
    pub offset: u64,
    /// Bytes written.
    pub len: u64,
    /// Who: the name the client gave in its hello, and its address.
    pub client: String,
    /// How the bytes arrived. `Bounce`: the server copied them into the region itself (a
    /// file region's bytes are durable once the client's flush returns). `Direct`: the
    /// client's own RDMA WRITEs through its window, which the server cannot observe; the
    /// client reports them once they completed, so such a notice is the client's word.
    pub path: DataPath,
}

/// The sending side, shared by the connections.
#[derive(Debug)]
pub(super) struct Notices(broadcast::Sender<PutNotice>);

impl Default for Notices {
    fn default() -> Self {
        Notices(broadcast::Sender::new(PUT_NOTICE_BACKLOG))
    }
}

impl Notices {
    /// Tell every subscriber (none: the notice is dropped).
    pub(super) fn put(&self, n: PutNotice) {
        tracing::debug!(region = n.region, offset = n.offset, len = n.len, client = n.client, path = %n.path, "put");
        let _ = self.0.send(n);
    }

    /// A new subscriber: it sees the puts that complete from now on.
    pub(super) fn subscribe(&self) -> broadcast::Receiver<PutNotice> {
        self.0.subscribe()
    }
}
