//! A loopback HTTP endpoint that keeps every JSON body POSTed to it: the
//! address of a notification-controller `Provider` of type `generic`, which
//! POSTs each event it forwards there, as Flux's eventv1.Event JSON.
//!
//! Each receiver serves on a thread of its own and stops when dropped. It
//! answers every request `200 OK` and closes the connection after it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// What one request brought.
#[derive(Clone, Debug)]
pub struct Received {
    /// `POST /path`.
    pub request_line: String,
    /// The body, parsed (`Value::Null` if it was not JSON).
    pub body: Value,
}

/// A running receiver.
pub struct WebhookReceiver {
    /// `http://127.0.0.1:PORT/`: a Provider's `spec.address`.
    pub url: String,
    received: Arc<Mutex<Vec<Received>>>,
    stopping: Arc<AtomicBool>,
    port: u16,
}

impl WebhookReceiver {
    /// Starts a receiver on a free loopback port.
    pub fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding 127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let received: Arc<Mutex<Vec<Received>>> = Arc::default();
        let stopping = Arc::new(AtomicBool::new(false));
        let (sink, stop) = (received.clone(), stopping.clone());
        std::thread::Builder::new()
            .name("webhook-receiver".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    if let Ok(stream) = stream
                        && let Ok(request) = read_request(&stream)
                    {
                        sink.lock().unwrap().push(request);
                        let _ = respond_ok(stream);
                    }
                }
            })?;
        Ok(Self {
            url: format!("http://127.0.0.1:{port}/"),
            received,
            stopping,
            port,
        })
    }

    /// Everything received so far, in order.
    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// Waits (at most `timeout`) for a body that satisfies `matches`, and
    /// returns it.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        matches: impl Fn(&Value) -> bool,
    ) -> Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(found) = self.received().into_iter().find(|r| matches(&r.body)) {
                return Ok(found.body);
            }
            if Instant::now() > deadline {
                bail!(
                    "timed out after {}s waiting for {what}; received: {:#?}",
                    timeout.as_secs(),
                    self.received()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for WebhookReceiver {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        // Wakes the accept loop so that it sees the flag and ends.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// Reads one HTTP/1.1 request: its request line, headers and a body of
/// `Content-Length` bytes (the generic provider sends no chunked bodies).
fn read_request(stream: &TcpStream) -> Result<Received> {
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(stream);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    let mut length = 0usize;
    loop {
        let mut header = String::new();
        reader.read_line(&mut header)?;
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().context("Content-Length")?;
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    Ok(Received {
        request_line: request_line.trim_end().to_owned(),
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
    })
}

fn respond_ok(mut stream: TcpStream) -> std::io::Result<()> {
    stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
}
