//! The p2p-rdma node: region catalog, control protocol, server and client.
//!
//! - [`protocol`]: the pure codec of the control protocol (length-prefixed JSON frames);
//! - [`server::Server`]: serves host RAM and files as RDMA regions, one PD and QP per connection;
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
pub mod protocol;
pub mod server;
pub mod size;
pub mod spec;
mod staging;
pub mod token;

pub use client::{
    BatchRange, Client, ClientConfig, Landed, LocalBuffer, OpenRegion, Stranded, TransferReport,
};
pub use error::{Error, Result};
pub use server::{
    MemoryRegionSpec, RegionOptions, RegionSource, RegionSpec, Removal, Server, ServerConfig,
    ServerHandle,
};
pub use token::{Grant, Scope, Token};
