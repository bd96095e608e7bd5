//! nrun's store served inside a test (on the test's runtime, a loopback port of its own), and
//! raw connections to a store. The workspace crates' tests include this file too (`#[path]`):
//! it needs nrun_store and tokio only.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;

use nrun_store::{Store, server};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpSocket, TcpStream};

/// Serves `store` on a loopback port of its own while the test's runtime runs; its address.
pub(crate) async fn serve_store(store: Arc<Store>) -> SocketAddr {
    let l = server::bind(0).unwrap();
    let port = l.local_addr().unwrap().port();
    let l = tokio::net::TcpListener::from_std(l).unwrap();
    tokio::spawn(async move { server::serve(l, store, std::future::pending()).await });
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// What a client's connection opens with: VALIDATE and its magic.
pub(crate) const VALIDATE: [u8; 5] = [0x00, 0xce, 0xf7, 0x85, 0x3c];

/// A validated raw connection from `from` (any 127.0.0.x: another "host") to `addr`.
pub(crate) async fn raw_from(from: [u8; 4], addr: SocketAddr) -> std::io::Result<TcpStream> {
    let sock = TcpSocket::new_v4()?;
    sock.bind(SocketAddr::from((from, 0)))?;
    let mut s = sock.connect(addr).await?;
    s.write_all(&VALIDATE).await?;
    Ok(s)
}
