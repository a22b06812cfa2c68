//! An HTTPS listener on loopback that plays an attacker's server: it serves
//! with the control plane's own certificate (so a client trusting testkit's
//! CA completes the handshake, as it would with a server the attacker
//! controls), records every request head it receives, and answers 500.
//! A test points a tenant's kubeconfig at it and asserts that nothing, and
//! above all no `Authorization` header, ever arrives.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::certs::Pki;

/// The most of a request head kept; an attacker's server needs no more to
/// read a header.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// What the trap has seen.
#[derive(Debug, Default, Clone)]
pub struct Caught {
    /// TCP connections accepted, whether or not TLS completed.
    pub connections: usize,
    /// The request heads received over TLS, as text.
    pub request_heads: Vec<String>,
}

impl Caught {
    /// The `Authorization` headers among the request heads.
    pub fn authorization_headers(&self) -> Vec<String> {
        self.request_heads
            .iter()
            .flat_map(|head| head.lines())
            .filter(|line| line.to_ascii_lowercase().starts_with("authorization:"))
            .map(str::to_owned)
            .collect()
    }
}

/// A running trap; it stops with the test's runtime.
pub struct TokenTrap {
    pub addr: SocketAddr,
    caught: Arc<Mutex<Caught>>,
}

impl TokenTrap {
    /// Starts a trap on `127.0.0.1:0`, serving with the certificate of `pki`.
    pub async fn start(pki: &Pki) -> Result<Self> {
        let certs = CertificateDer::pem_file_iter(&pki.serving_cert)
            .context("reading the serving certificate")?
            .collect::<Result<Vec<_>, _>>()?;
        let key =
            PrivateKeyDer::from_pem_file(&pki.serving_key).context("reading the serving key")?;
        let config = ServerConfig::builder_with_provider(Arc::new(
            tokio_rustls::rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let caught: Arc<Mutex<Caught>> = Arc::default();
        let recorded = caught.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                recorded.lock().unwrap().connections += 1;
                let (acceptor, recorded) = (acceptor.clone(), recorded.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(stream).await else {
                        return;
                    };
                    let mut head = Vec::new();
                    let mut buffer = [0u8; 4096];
                    while head.len() < MAX_HEAD_BYTES && !head.windows(4).any(|w| w == b"\r\n\r\n")
                    {
                        match tls.read(&mut buffer).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => head.extend_from_slice(&buffer[..n]),
                        }
                    }
                    if !head.is_empty() {
                        recorded
                            .lock()
                            .unwrap()
                            .request_heads
                            .push(String::from_utf8_lossy(&head).into_owned());
                    }
                    let _ = tls
                        .write_all(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                        .await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        Ok(Self { addr, caught })
    }

    /// `https://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// What the trap has seen so far.
    pub fn caught(&self) -> Caught {
        self.caught.lock().unwrap().clone()
    }
}
