//! The rendezvous store: PyTorch's c10d TCPStore protocol, served by nrun so that
//! `init_process_group("env://")` needs no change.
//!
//! - [`protocol`]: opcodes and a pure, never-panicking codec over byte buffers.
//! - [`server`]: the tokio server (waits, barriers, queues, limits).
//! - [`client`]: a Rust client for the same protocol (agents, preflight, tests, load generator).
//! - [`auth`]: proving the run's secret (HMAC-SHA256 over a challenge) and sealing steps.

pub mod auth;
pub mod client;
pub mod protocol;
pub mod server;

pub use server::Store;
