//! The p2p-rdma node: region catalog, control protocol, server and client. The control protocol
//! and the serve/fetch/put paths land with their issue; until then this crate only fixes the
//! workspace layout.
#![forbid(unsafe_code)]
