//! A cluster-wide catalog of p2p-rdma regions, kept in etcd.
//!
//! A serving node publishes each region it serves (name, size, access, kind, data path, its
//! control endpoints and NIC) under a lease it keeps alive ([`Publisher`]); a client resolves a
//! region by name to the nodes that serve it, best first ([`Catalog::resolve`], the rule in
//! [`choose`]), lists the whole cluster, or watches regions come and go. The catalog holds no
//! secret: clients still present their token to the node they connect to.
//!
//! Key layout and lease rules: [`keys`] and [`publish`].

#![forbid(unsafe_code)]

pub mod catalog;
pub mod choose;
pub mod entry;
mod error;
pub mod keys;
pub mod open;
pub mod publish;
pub mod reconcile;
pub mod server;
pub mod url;
pub mod watch;

pub use catalog::{Catalog, CatalogEvent, CatalogOptions, Listing};
pub use choose::Replica;
pub use entry::{NodeEntry, RegionEntry};
pub use error::{Error, EtcdFailure, Result};
pub use publish::{PublishStatus, Publisher, PublisherConfig};
pub use url::CatalogUrl;
pub use watch::CatalogWatch;
