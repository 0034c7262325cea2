//! The p2p-rdma node: region catalog, control protocol, server and client.
//!
//! - [`protocol`]: the pure codec of the control protocol (length-prefixed JSON frames);
//! - [`server::Server`]: serves host RAM, files and device memory as RDMA regions, one QP per
//!   connection, each region registered once and reached through a memory window per client;
//! - [`client::Client`]: lists, opens, fetches and puts with chunked one-sided RDMA.
#![forbid(unsafe_code)]

pub mod client;
mod conn;
pub mod error;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod http;
pub mod metrics;
pub mod path;
mod piece;
pub mod protocol;
mod qp_path;
pub mod server;
pub mod size;
pub mod spec;
mod staging;
pub mod stripe;
pub mod token;

pub use client::{
    BatchRange, Client, ClientConfig, Landed, LocalBuffer, OpenFor, OpenRegion, Resumed, Retries,
    SinkFor, SourceFor, Stranded, Striped, TransferReport, Transport, DEFAULT_INLINE,
};
pub use error::{Error, Result};
pub use qp_path::QpPath;
pub use server::{
    MemoryRegionSpec, PutNotice, RegionOptions, RegionSource, RegionSpec, Removal, Server,
    ServerConfig, ServerHandle, SharingPolicy, PUT_NOTICE_BACKLOG,
};
pub use token::{Grant, Scope, Token};
